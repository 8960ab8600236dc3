"""The intake's signature schemes over real HTTP, each signed by the provider's
own library: Standard Webhooks (the `standardwebhooks` package) on generic
sources, Slack (`slack_sdk`), GitHub's form-encoded deliveries; the old
body-only scheme only where configured; and the secrets file's entry format,
placeholder and length refusals, and cut-off files.

Servers run in a thread (tests.test_ingest_server.serving) or as the
`ingest-server` process; the client is urllib.request.
"""

import base64
import hashlib
import hmac
import json
import os
import random
import time
import urllib.parse
from datetime import datetime, timezone

import pytest
from slack_sdk.signature import SignatureVerifier
from standardwebhooks import Webhook

from agent_inbox import errors
from agent_inbox.services.ingest import signatures
from agent_inbox.services.ingest.app import build_app
from agent_inbox.services.ingest.secrets import Credential, SecretStore, load_secrets

from tests.test_ingest_server import (ROOT, get, post, serving, sign, spawn_server,  # noqa: F401
                                      stored)

# Standard Webhooks secrets are whsec_<base64 of the key>.
CRM_SECRET = "whsec_" + base64.b64encode(b"crm-key-0123456789abcdef").decode()
CRM_OLD_SECRET = "whsec_" + base64.b64encode(b"crm-old-key-9876543210zy").decode()
SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"  # the shape of a Slack signing secret
SLACK_OLD_SECRET = "0123456789abcdef0123456789abcdef"
GITHUB_SECRET = "It's a Secret to Everybody"
LEGACY_SECRET = "legacy-body-secret-Q7"
SECRETS = {
    "alice": {
        "crm": CRM_SECRET,
        "slack": [SLACK_SECRET, SLACK_OLD_SECRET],
        "github": GITHUB_SECRET,
        "legacy": {"scheme": "hmac-body", "secret": LEGACY_SECRET},
    },
}
MAX_BODY = 4096


@pytest.fixture
def base(inbox):
    with serving(build_app(inbox, SECRETS, MAX_BODY, 300, threads=4)) as url:
        yield url


def utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


# --- Standard Webhooks ------------------------------------------------------------

def standard(base, user, source, payload, *, secret=CRM_SECRET, msg_id="msg_1", t=None,
             raw: bytes | None = None, signature: str | None = None, headers=None):
    """POST a delivery signed by the standardwebhooks package (as a sender does)."""
    body = raw if raw is not None else json.dumps(payload).encode()
    t = int(time.time()) if t is None else t
    if signature is None:
        signature = Webhook(secret).sign(msg_id, utc(t), body.decode())
    sent = {"Content-Type": "application/json", "webhook-id": msg_id,
            "webhook-timestamp": str(t), "webhook-signature": signature, **(headers or {})}
    return post(f"{base}/hooks/{source}/{user}", body, sent)


def test_a_standard_webhook_is_stored_under_its_webhook_id_with_its_type_as_kind(base, inbox):
    payload = {"type": "invoice.paid", "data": {"amount": 1200}}
    assert standard(base, "alice", "crm", payload, msg_id="msg_2Kx") == (202, {"status": "accepted"})
    # A redelivery is signed afresh (new timestamp): a duplicate under its id.
    assert standard(base, "alice", "crm", payload, msg_id="msg_2Kx",
                    t=int(time.time()) - 30) == (200, {"status": "duplicate"})
    assert standard(base, "alice", "crm", ["no", "type"], msg_id="msg_list")[0] == 202
    assert standard(base, "alice", "crm", {"type": 7}, msg_id="msg_num")[0] == 202
    assert [(e.source, e.source_id, e.kind, e.payload) for e in inbox.events("alice")] == [
        ("crm", "msg_2Kx", "invoice.paid", payload), ("crm", "msg_list", None, ["no", "type"]),
        ("crm", "msg_num", None, {"type": 7})]


def test_standard_webhooks_accepts_any_signature_while_the_sender_rotates(base, inbox):
    body = json.dumps({"type": "rotated"}).encode()
    t = int(time.time())
    old = Webhook(CRM_OLD_SECRET).sign("msg_rot", utc(t), body.decode())
    new = Webhook(CRM_SECRET).sign("msg_rot", utc(t), body.decode())
    wrong = Webhook(CRM_OLD_SECRET).sign("msg_rot", utc(t), body.decode() + " ")
    # Old first, then new; and a version this intake does not know is skipped.
    assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_rot", t=t,
                    signature=f"{old} v2,abcd {new}") == (202, {"status": "accepted"})
    # New first, then old.
    assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_rot", t=t,
                    signature=f"{new} {old}") == (200, {"status": "duplicate"})
    # Only signatures that do not match: refused.
    assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_rot2", t=t,
                    signature=f"{old} {wrong}") == (401, {"error": "signature verification failed"})
    assert stored(inbox) == [("crm", "msg_rot", {"type": "rotated"})]


def test_standard_webhooks_refuses_old_future_replayed_and_tampered_deliveries(base, inbox):
    now = int(time.time())
    body = json.dumps({"type": "x", "n": 1}).encode()
    refused = (401, {"error": "signature verification failed"})
    # Signed correctly, but 6 minutes old, and 6 minutes ahead: the package refuses both too.
    for t in (now - 360, now + 360):
        signature = Webhook(CRM_SECRET).sign("msg_t", utc(t), body.decode())
        assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_t", t=t,
                        signature=signature) == refused, t
        with pytest.raises(Exception):
            Webhook(CRM_SECRET).verify(body, {"webhook-id": "msg_t", "webhook-timestamp": str(t),
                                              "webhook-signature": signature})
    signature = Webhook(CRM_SECRET).sign("msg_orig", utc(now), body.decode())
    # Replayed under another webhook-id (the event key): refused.
    assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_new", t=now,
                    signature=signature) == refused
    # Replayed with a fresh timestamp on the old signature: refused.
    assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_orig", t=now + 1,
                    signature=signature) == refused
    # The body changed by one byte: refused.
    assert standard(base, "alice", "crm", None, raw=body.replace(b"1", b"2"), msg_id="msg_orig",
                    t=now, signature=signature) == refused
    # Malformed headers.
    for bad in ("", "v1", "v1,", "v1,***", signature.replace("v1,", "v1,,"),
                signature[3:], " ".join([signature] * 9)):
        assert standard(base, "alice", "crm", None, raw=body, msg_id="msg_orig", t=now,
                        signature=bad) == refused, bad
    for stamp in ("", "abc", f"{now}.5", f"+{now}", f"0{now}", "١٧٠٠".encode()):
        status, _ = post(f"{base}/hooks/crm/alice", body,
                         {"webhook-id": "msg_orig", "webhook-timestamp": stamp,
                          "webhook-signature": signature})
        assert status == 401, stamp
    status, answer = post(f"{base}/hooks/crm/alice", body, {"webhook-signature": signature,
                                                            "webhook-timestamp": str(now)})
    assert (status, answer) == refused  # no webhook-id: nothing was signed under a key
    assert stored(inbox) == []


def test_a_generic_source_takes_only_its_configured_scheme(base, inbox):
    body = json.dumps({"type": "x"}).encode()
    refused = (401, {"error": "signature verification failed"})
    # The body-only signature, made with the Standard Webhooks source's key: refused.
    key = signatures.standard_webhooks_key(CRM_SECRET)
    assert post(f"{base}/hooks/crm/alice", body,
                {"X-Signature": "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest(),
                 "Idempotency-Key": "k"}) == refused
    # A Standard Webhooks delivery to the hmac-body source: refused.
    assert standard(base, "alice", "legacy", {"type": "x"}, secret="whsec_" + base64.b64encode(
        LEGACY_SECRET.encode()).decode(), msg_id="m") == refused
    # The hmac-body source still takes its scheme.
    assert post(f"{base}/hooks/legacy/alice", body,
                {"X-Signature": sign(LEGACY_SECRET, body), "Idempotency-Key": "leg-1",
                 "X-Event-Type": "Issue"}) == (202, {"status": "accepted"})
    # Neither header: the standard one is named, whatever the source's scheme.
    for source in ("crm", "legacy", "nosuch"):
        assert post(f"{base}/hooks/{source}/alice", body, {"Idempotency-Key": "k"}) == (
            401, {"error": "missing webhook-signature header"}), source
    assert [(e.source, e.source_id, e.kind) for e in inbox.events("alice")] == [
        ("legacy", "leg-1", "Issue")]


def test_no_secret_is_refused_like_a_bad_signature_for_either_generic_scheme(base, inbox):
    refused = (401, {"error": "signature verification failed"})
    assert standard(base, "alice", "nosuch", {"a": 1}) == refused       # unknown source
    assert standard(base, "mallory", "crm", {"a": 1}) == refused        # unknown user
    assert standard(base, "alice", "crm", {"a": 1}, secret=CRM_OLD_SECRET) == refused
    body = b"{}"
    assert post(f"{base}/hooks/nosuch/alice", body,
                {"X-Signature": sign("x" * 16, body), "Idempotency-Key": "k"}) == refused
    assert stored(inbox) == [] and stored(inbox, "mallory") == []


def test_our_standard_webhooks_check_equals_the_package_on_its_deliveries_and_mutations():
    """Random secrets, ids, bodies and times, each signed by the package and then
    mutated: our check accepts exactly what Webhook.verify accepts."""
    rng = random.Random(10)
    cases = 0
    for _ in range(300):
        key = rng.randbytes(rng.choice((16, 24, 32, 64)))
        encoded = base64.b64encode(key).decode()
        secret = rng.choice(("whsec_" + encoded, encoded, "whsec_" + encoded.rstrip("=")))
        assert signatures.standard_webhooks_key(secret) == key == Webhook(secret)._whsecret
        msg_id = "msg_" + "".join(rng.choices("abcdefXYZ0123456789_-", k=rng.randint(1, 30)))
        body = json.dumps({"type": "t", "v": rng.random(), "s": "é✓"}).encode()
        now = time.time()
        t = int(now) + rng.choice((0, -1, 1, -200, 200, -290, 290, -310, 310, -1000, 5000))
        good = Webhook(secret).sign(msg_id, utc(t), body.decode())
        other = Webhook("whsec_" + base64.b64encode(rng.randbytes(24)).decode()).sign(
            msg_id, utc(t), body.decode())
        variants = [
            (msg_id, str(t), good, body),
            (msg_id, str(t), f"{other} {good}", body),
            (msg_id, str(t), f"{good} {other}", body),
            (msg_id, str(t), other, body),
            (msg_id, str(t), "v2," + good[3:], body),
            (msg_id, str(t), f"v1a,{good[3:]} {good}", body),
            (msg_id + "x", str(t), good, body),
            (msg_id, str(t + 1), good, body),
            (msg_id, str(t), good, body + b" "),
            (msg_id, str(t), good[:-4] + "AAA=", body),
        ]
        for vid, vt, vsig, vbody in variants:
            try:
                Webhook(secret).verify(vbody, {"webhook-id": vid, "webhook-timestamp": vt,
                                               "webhook-signature": vsig})
                theirs = True
            except Exception:
                theirs = False
            ours = signatures.verify_standard_webhooks(
                (key,), vbody, vid.encode(), vt, vsig, now=time.time())
            assert ours == theirs, (secret, vid, vt, vsig, vbody)
            cases += 1
        # Headers the package never produces: ours is stricter (refuses), never looser.
        for vt, vsig in ((str(t), f"{good} v1,"), (str(t), f"{good}  {other}"),
                         ("0" + str(t), good), (str(t), good.replace("=", "") + "*"),
                         (f"{t}.0", good)):
            ours = signatures.verify_standard_webhooks(
                (key,), body, msg_id.encode(), vt, vsig, now=time.time())
            assert not ours, (vt, vsig)
    assert cases == 3000


def test_github_signature_matches_githubs_documented_test_vector():
    # docs.github.com, "Validating webhook deliveries": this secret, this body, this digest.
    digest = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert signatures.verify_github_any((b"It's a Secret to Everybody",) + (b"x" * 32,),
                                        b"Hello, World!", digest)
    assert not signatures.verify_github_any((b"x" * 32, b"y" * 32), b"Hello, World!", digest)


# --- Slack ----------------------------------------------------------------------------

def slack(base, user, payload, *, secret=SLACK_SECRET, t=None, raw: bytes | None = None,
          headers=None):
    """POST a request signed as slack_sdk's SignatureVerifier computes it."""
    body = raw if raw is not None else json.dumps(payload).encode()
    t = str(int(time.time()) if t is None else t)
    sent = {"Content-Type": "application/json", "X-Slack-Request-Timestamp": t,
            "X-Slack-Signature": SignatureVerifier(secret).generate_signature(timestamp=t,
                                                                              body=body),
            **(headers or {})}
    return post(f"{base}/hooks/slack/{user}", body, sent)


def slack_event(event_id: str, kind: str = "message") -> dict:
    return {"type": "event_callback", "team_id": "T1", "event_id": event_id,
            "event": {"type": kind, "text": "hello", "user": "U1"}}


def test_slack_url_verification_is_answered_with_its_challenge_once_signed(base, inbox):
    challenge = {"token": "Jhj5dZrVaK7ZwHHjRyZWjbDl", "type": "url_verification",
                 "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"}
    assert slack(base, "alice", challenge) == (200, {"challenge": challenge["challenge"]})
    # Unsigned or badly signed: no echo of the challenge.
    assert slack(base, "alice", challenge, secret="f" * 32) == (
        401, {"error": "signature verification failed"})
    assert slack(base, "alice", {"type": "url_verification"})[0] == 400
    assert stored(inbox) == []


def test_a_slack_event_is_stored_under_its_event_id_and_a_retry_is_a_duplicate(base, inbox):
    event = slack_event("Ev0PV52K21", "app_mention")
    assert slack(base, "alice", event) == (202, {"status": "accepted"})
    retry = {"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"}
    assert slack(base, "alice", event, headers=retry) == (200, {"status": "duplicate"})
    # The retry of an event whose first delivery never got stored is stored.
    assert slack(base, "alice", slack_event("Ev0PV52K22"), headers=retry) == (
        202, {"status": "accepted"})
    # Signed with the second secret of the source (being rotated).
    assert slack(base, "alice", slack_event("Ev0PV52K23"), secret=SLACK_OLD_SECRET)[0] == 202
    assert [(e.source, e.source_id, e.kind) for e in inbox.events("alice")] == [
        ("slack", "Ev0PV52K21", "app_mention"), ("slack", "Ev0PV52K22", "message"),
        ("slack", "Ev0PV52K23", "message")]


def test_slack_refuses_old_future_replayed_tampered_and_keyless_requests(base, inbox):
    now = int(time.time())
    refused = (401, {"error": "signature verification failed"})
    for t in (now - 360, now + 360):
        assert slack(base, "alice", slack_event("Ev_t"), t=t) == refused, t
        body = json.dumps(slack_event("Ev_t")).encode()
        signature = SignatureVerifier(SLACK_SECRET).generate_signature(timestamp=str(t),
                                                                       body=body)
        assert not SignatureVerifier(SLACK_SECRET).is_valid(body, str(t), signature)
    body = json.dumps(slack_event("Ev_r")).encode()
    signature = SignatureVerifier(SLACK_SECRET).generate_signature(timestamp=str(now), body=body)
    assert SignatureVerifier(SLACK_SECRET).is_valid(body, str(now), signature)
    for stamp, sent_body, sig in ((str(now + 1), body, signature),         # a new timestamp
                                  (str(now), body.replace(b"hello", b"hellp"), signature),
                                  (str(now), body, signature.replace("v0=", "v1=")),
                                  (str(now), body, signature[3:]),
                                  (f"+{now}", body, signature), (f"{now}.0", body, signature),
                                  (f"{now:_}", body, signature)):
        assert post(f"{base}/hooks/slack/alice", sent_body,
                    {"X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": sig}) == refused
    assert post(f"{base}/hooks/slack/alice", body, {"X-Slack-Request-Timestamp": str(now)}) == (
        401, {"error": "missing X-Slack-Signature header"})
    assert slack(base, "mallory", slack_event("Ev_m")) == refused
    # Signed, but no event_id to store it under.
    assert slack(base, "alice", {"type": "event_callback", "event": {"type": "message"}}) == (
        400, {"error": "missing body event_id"})
    assert stored(inbox) == [] and stored(inbox, "mallory") == []


# --- GitHub, form-encoded ------------------------------------------------------------

def form_body(payload) -> bytes:
    """What GitHub sends with content type application/x-www-form-urlencoded."""
    return ("payload=" + urllib.parse.quote_plus(json.dumps(payload))).encode()


def github_form(base, body: bytes, delivery: str, signature: str | None = None):
    return post(f"{base}/hooks/github/alice", body, {
        "Content-Type": "application/x-www-form-urlencoded", "X-GitHub-Event": "push",
        "X-GitHub-Delivery": delivery,
        "X-Hub-Signature-256": signature or sign(GITHUB_SECRET, body)})


def test_a_form_encoded_github_delivery_is_stored_as_its_json_payload(base, inbox):
    payload = {"ref": "refs/heads/main", "message": "a+b & c=d 100% é✓",
               "commits": [{"id": "abc"}]}
    body = form_body(payload)
    assert b"%" in body and b"+" in body  # really url-encoded
    assert github_form(base, body, "form-1") == (202, {"status": "accepted"})
    assert [(e.source_id, e.kind, e.payload) for e in inbox.events("alice")] == [
        ("form-1", "push", payload)]


def test_a_form_encoded_github_delivery_is_checked_over_its_raw_body(base, inbox):
    payload = {"n": 1}
    body = form_body(payload)
    refused = (401, {"error": "signature verification failed"})
    # Signed over the JSON inside instead of the body as sent: refused.
    assert github_form(base, body, "f-1", sign(GITHUB_SECRET, json.dumps(payload).encode())) \
        == refused
    # The same JSON, encoded differently, under the first body's signature: refused.
    assert github_form(base, body.replace(b"%7B", b"%7b"), "f-2", sign(GITHUB_SECRET, body)) \
        == refused
    # Signed, but not GitHub's form.
    for bad in (b"payload=%7B%7D&extra=1", b"payload=not-json", b"payload=%FF",
                b"payload=" + "é".encode(), b"payload=%7B%7D&" * 20):
        status, answer = github_form(base, bad, "f-bad")
        assert status == 400 and answer["error"], bad
    assert stored(inbox) == []


# --- the secrets file ---------------------------------------------------------------

def refusal(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(errors.InvalidInput) as caught:
        load_secrets(path)
    return str(caught.value)


def test_the_committed_example_secrets_file_is_refused_as_placeholders():
    example = os.path.join(ROOT, "deploy", "webhook-secrets.example.json")
    with pytest.raises(errors.InvalidInput) as caught:
        load_secrets(example)
    message = str(caught.value)
    assert "user 'alice' source" in message and "placeholder" in message
    assert "replace-with" not in message


def test_entries_are_checked_with_specific_errors_that_never_show_the_secret(tmp_path):
    good = "a-good-secret-0123456789"
    whsec = "whsec_" + base64.b64encode(b"k" * 24).decode()
    cases = {
        "short": ({"alice": {"github": "short-Secret-1"}},
                  "user 'alice' source 'github': the secret is 14 bytes; at least 16"),
        "short-key": ({"alice": {"crm": "whsec_" + base64.b64encode(b"k" * 12).decode()}},
                      "decodes to 12 bytes; at least 16"),
        "placeholder": ({"alice": {"stripe": "whsec_REPLACE-WITH-your-secret"}}, "placeholder"),
        "changeme": ({"bob": {"github": "changeme-changeme-1"}}, "user 'bob'"),
        # Not base64 (the package would drop the dashes and decode the rest).
        "not-base64": ({"alice": {"crm": "my-webhook-shared-secret-value-2024"}}, "hmac-body"),
        "unknown-scheme": ({"alice": {"crm": {"scheme": "hmac-sha1", "secret": good}}},
                           "unknown scheme (the schemes are github, stripe, slack, "
                           "standard-webhooks, hmac-body)"),
        "wrong-scheme": ({"alice": {"github": {"scheme": "hmac-body", "secret": good}}},
                         "scheme 'hmac-body' is not for this source (it takes github)"),
        "provider-scheme": ({"alice": {"crm": {"scheme": "stripe", "secret": good}}},
                            "it takes standard-webhooks or hmac-body"),
        "missing-secret": ({"alice": {"crm": {"scheme": "hmac-body"}}}, "needs a secret"),
        "both": ({"alice": {"crm": {"secret": good, "secrets": [good]}}}, "exactly one"),
        "unknown-field": ({"alice": {"crm": {"scheme": "hmac-body", "secret": good, "sha": 1}}},
                          "unknown field 'sha'"),
        "three": ({"alice": {"github": [good, good + "1", good + "2"]}}, "1 to 2"),
        "empty-list": ({"alice": {"github": []}}, "1 to 2"),
        "no-user": ({}, "holds no user"),
        "no-source": ({"alice": {}}, "user 'alice' has no source"),
    }
    for name, (data, expected) in cases.items():
        message = refusal(tmp_path, f"{name}.json", json.dumps(data))
        assert expected in message, (name, message)
        for secret in (good, whsec, "short-Secret-1", "my-webhook-shared-secret-value-2024",
                       "changeme-changeme-1"):
            assert secret not in message, (name, message)
    # And what is accepted: a scheme object, a rotation list, both generic schemes.
    path = tmp_path / "ok.toml"
    path.write_text(f'[alice]\ngithub = ["{good}", "{good}-old"]\ncrm = "{whsec}"\n'
                    f'legacy = {{ scheme = "hmac-body", secret = "{good}" }}\n\n'
                    f'[alice.billing]\nscheme = "standard-webhooks"\nsecrets = ["{whsec}"]\n')
    loaded = load_secrets(path)
    assert loaded["alice"]["github"] == Credential("github", (good.encode(), f"{good}-old".encode()))
    assert loaded["alice"]["crm"] == loaded["alice"]["billing"] == Credential(
        "standard-webhooks", (b"k" * 24,))
    assert loaded["alice"]["legacy"] == Credential("hmac-body", (good.encode(),))
    assert good not in repr(loaded) and "k" * 24 not in repr(loaded)


TOML = """[alice]
github = "alice-github-secret-0001"
stripe = { secret = "whsec_alice-stripe-secret-02" }

[bob]
github = "bob-github-secret-00000003"

[bob.legacy]
scheme = "hmac-body"
secret = "bob-legacy-secret-0000004"

[carol]
slack = ["carol-slack-secret-000005", "carol-slack-secret-000006"]
"""


def test_a_toml_file_cut_off_anywhere_but_between_complete_lines_is_refused(tmp_path):
    """Every byte prefix of a secrets file, as a reader racing a writer in place
    might see it: refused, except the prefixes that end exactly after a complete
    `key = value` line (undetectable from the content: README says replace the
    file by rename, and a reload that would remove entries reads it again)."""
    raw = TOML.encode()
    path = tmp_path / "cut.toml"
    path.write_bytes(raw)
    full = load_secrets(path)
    def last_line(cut):
        lines = [line for line in raw[:cut].split(b"\n") if line.strip()]
        return lines[-1] if lines else b""

    complete_lines = {cut for cut in range(1, len(raw)) if raw[cut - 1] == ord("\n")
                      and b" = " in last_line(cut)}
    loaded_at = set()
    for cut in range(len(raw)):
        path.write_bytes(raw[:cut])
        try:
            prefix = load_secrets(path)
        except errors.InvalidInput as exc:
            assert "secret-0" not in str(exc)
            continue
        loaded_at.add(cut)
        assert prefix != full
    # Refused: every cut inside a line, after a table header, inside [bob.legacy].
    legacy_scheme = raw.index(b'scheme = "hmac-body"\n') + len(b'scheme = "hmac-body"\n')
    assert loaded_at == complete_lines - {legacy_scheme, legacy_scheme + 1}


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path, monkeypatch):
    from agent_inbox.services.ingest import secrets as module

    path = tmp_path / "s.toml"
    path.write_text(TOML)
    real_fstat = os.fstat
    calls = []

    def growing_fstat(fd):  # the second look sees a writer's later bytes
        calls.append(fd)
        result = real_fstat(fd)
        if len(calls) == 2:
            return os.stat_result((*result[:6], result.st_size + 10, *result[7:]))
        return result

    monkeypatch.setattr(module.os, "fstat", growing_fstat)
    with pytest.raises(errors.InvalidInput, match="changed while it was being read"):
        load_secrets(path)


def test_a_reload_that_would_remove_users_waits_for_the_writer_to_finish(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(TOML)
    store = SecretStore.from_file(path)
    cut = TOML.index("[bob]")
    path.write_text(TOML[:cut])  # a writer in place, part-way: bob and carol missing

    import threading

    def finish():
        time.sleep(0.05)
        staging = tmp_path / "s.toml.new"
        staging.write_text(TOML + '\n[dave]\ngithub = "dave-github-secret-00007"\n')
        os.replace(staging, path)

    writer = threading.Thread(target=finish)
    writer.start()
    assert store.reload()
    writer.join()
    assert store.get("carol", "slack") is not None and store.get("dave", "github") is not None
    # A file that stays cut is a change the operator made: loaded, and logged as removals.
    path.write_text(TOML[:cut])
    assert store.reload() and store.get("bob", "github") is None


def test_the_command_refuses_placeholder_and_short_secrets_with_exit_2(spawn_server,  # noqa: F811
                                                                      database_url, tmp_path):
    example = os.path.join(ROOT, "deploy", "webhook-secrets.example.json")
    short = tmp_path / "short.toml"
    short.write_text('[alice]\ngithub = "gh-Secret-15byt"\n')
    for path, expected in ((example, "the secret is still a placeholder"),
                           (str(short), "user 'alice' source 'github': the secret is 15 bytes")):
        server = spawn_server("--database-url", database_url, "--secrets", path, "--port", "0")
        assert server.process.wait(timeout=60) == 2
        server._reader.join(timeout=5)
        assert expected in server.output, server.output
        assert "replace-with" not in server.output and "gh-Secret-15byt" not in server.output
