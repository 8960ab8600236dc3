"""Timers and approvals on the Citus cluster (the single-server tests, run
here unchanged): a scheduler fires one bucket's due timers at a time, one by
one, and their events get lease rows and wakes as an ingest's do; an answer
and the expiry still race under one key."""

from tests.test_parked_timers import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_cron_timer_that_raises_is_parked_and_the_others_fire,
    test_a_row_that_fails_the_set_based_firing_is_parked_and_the_others_fire,
    test_re_arming_an_approval_clears_its_parked_expiry,
)
from tests.test_timers_approvals_outbox import (  # noqa: F401
    test_a_cron_timer_can_catch_up,
    test_a_cron_timer_fires_on_its_schedule_in_its_time_zone,
    test_a_due_timer_fires_once_and_advances_on_its_grid,
    test_a_one_off_with_a_fixed_key_fires_once_and_is_done,
    test_an_answer_at_or_after_the_deadline_stores_the_expiry,
    test_an_unknown_request_is_unknown_and_stores_nothing,
    test_answer_before_the_deadline_stands_and_a_second_tap_is_ignored,
    test_catch_up_emits_one_event_per_missed_occurrence_each_under_its_own_key,
    test_catch_up_keeps_the_latest_occurrences_up_to_its_limit_and_reports_the_overflow,
    test_missed_occurrences_coalesce_into_the_latest,
    test_replaying_a_schedule_with_its_old_due_time_is_a_duplicate,
    test_the_scheduler_drains_more_timers_than_one_batch,
    test_the_scheduler_serves_every_user,
)
