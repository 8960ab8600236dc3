"""Stripe deliveries signed by Stripe's own library are accepted, and what
Stripe's library refuses we refuse (over real HTTP on loopback)."""

import json

import pytest
from stripe import SignatureVerificationError, WebhookSignature

from agent_inbox.services.ingest.app import build_app
from tests.test_ingest_server import STRIPE_SECRET, post, serving, stored


@pytest.fixture
def base(inbox):
    with serving(build_app(inbox, {"alice": {"stripe": STRIPE_SECRET}})) as url:
        yield url


def deliver(base, body: str, header: str):
    return post(f"{base}/hooks/stripe/alice", body.encode(),
                {"Content-Type": "application/json", "Stripe-Signature": header})


def test_a_delivery_signed_by_stripes_library_is_stored(base, inbox):
    body = json.dumps({"id": "evt_1", "type": "invoice.paid", "data": {}})
    header = WebhookSignature.generate_signature_header(body, STRIPE_SECRET)
    assert deliver(base, body, header) == (202, {"status": "accepted"})
    assert stored(inbox) == [("stripe", "evt_1", json.loads(body))]
    assert [e.kind for e in inbox.events("alice")] == ["invoice.paid"]
    assert deliver(base, body, header) == (200, {"status": "duplicate"})


@pytest.mark.parametrize("tamper", ["body", "secret", "stale"])
def test_what_stripes_library_refuses_is_refused(base, inbox, tamper):
    body = json.dumps({"id": "evt_2", "type": "invoice.paid"})
    header = WebhookSignature.generate_signature_header(
        body, STRIPE_SECRET + "x" if tamper == "secret" else STRIPE_SECRET,
        timestamp=1_000_000 if tamper == "stale" else None)
    sent = body.replace("evt_2", "evt_3") if tamper == "body" else body
    with pytest.raises(SignatureVerificationError):
        WebhookSignature.verify_header(sent, header, STRIPE_SECRET, tolerance=300)
    status, _ = deliver(base, sent, header)
    assert status == 401 and stored(inbox) == []
