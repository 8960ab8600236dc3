"""Durable steps on Citus: tests/test_steps.py's functions, run against this
folder's cluster (the steps table distributed by bucket, co-located with the
user's lease: every record, read and cleanup routed to the user's node)."""

from tests.test_steps import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_requeued_dead_event_starts_with_no_steps,
    test_a_retry_of_the_same_events_replays_its_recorded_steps,
    test_a_retry_that_claims_other_events_starts_without_steps,
    test_a_stale_generations_step_is_refused_and_stores_nothing,
    test_a_step_racing_a_takeover_waits_for_it_and_is_refused,
    test_an_error_keeps_the_steps_and_the_retry_resumes,
    test_async_steps_replay_in_call_order,
    test_step_key_is_the_same_on_every_attempt_and_names_the_occurrence,
    test_step_results_and_names_are_checked_and_nothing_is_stored,
    test_steps_asked_in_another_order_get_a_clear_error,
)
