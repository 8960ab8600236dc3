"""The webhook intake on the Citus cluster (the single-server tests, run here
unchanged): a signed delivery is stored once, its user's lease row and wake
created with it; bad deliveries store nothing."""

from tests.test_ingest_server import (  # noqa: F401 -- collected here, under this folder's fixtures
    base,
    test_a_bad_signature_is_refused_and_nothing_is_stored,
    test_github_delivery_is_stored_then_redelivery_is_a_duplicate,
    test_stripe_event_is_stored_under_its_body_id_then_redelivery_is_a_duplicate,
    test_the_same_key_from_another_source_or_user_is_a_different_event,
)


def test_a_delivery_through_the_intake_can_be_taken(base, inbox):
    test_github_delivery_is_stored_then_redelivery_is_a_duplicate(base, inbox)
    run = inbox.take_work("W")
    assert run is not None and run.user == "alice" and len(run.events) == 1
