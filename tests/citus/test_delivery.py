"""The dispatcher on the Citus cluster (tests/runtime/test_delivery.py's
tests, run here unchanged): claims one bucket at a time, outcomes recorded
per bucket, each transaction on one node."""

from tests.runtime.test_delivery import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_channel_error_postgresql_cannot_store_does_not_stop_the_dispatcher,
    test_a_claim_whose_deadline_is_now_does_not_spin_the_pass,
    test_a_dispatcher_that_died_mid_send_is_followed_after_its_deadline_same_key,
    test_a_finish_does_not_cut_a_failed_batchs_backoff_short,
    test_a_message_queued_while_a_dispatcher_decides_is_not_lost,
    test_a_permanent_refusal_parks_at_once,
    test_an_operator_retry_does_not_send_a_second_batch_inside_the_gap,
    test_failed_sends_back_off_then_park_and_later_messages_go_on,
    test_one_slow_send_does_not_hold_back_every_other_users_delivery,
    test_operators_see_retry_and_discard_failed_batches,
    test_sends_run_at_once_with_no_connection_busy_or_lock_held,
    test_two_dispatchers_at_once_send_every_batch_once,
)
