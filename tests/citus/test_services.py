"""The services as processes on the Citus cluster (the single-server tests,
run here unchanged): a worker woken by the notification an ingest's client
session sends on the coordinator, renewing, losing and releasing leases per
bucket; the scheduler's and the dispatcher's passes; a dispatcher process
stopped or killed mid-send."""

from tests.runtime.conftest import spawn  # noqa: F401 -- the fixture, for the tests below
from tests.runtime.test_dispatcher_process import (  # noqa: F401
    sends,
    test_a_killed_dispatchers_batches_go_again_after_the_deadline_same_keys,
    test_sigterm_waits_for_the_sends_in_flight_and_marks_them,
)
from tests.runtime.test_scheduler_dispatcher import (  # noqa: F401
    test_a_batch_resent_after_a_crash_keeps_its_rows_and_key,
    test_a_dispatcher_pass_sends_each_due_user_once_with_a_batch_key,
    test_a_scheduler_pass_fires_due_timers_and_says_when_the_next_is_due,
    test_an_urgent_message_goes_at_once_inside_the_gap,
    test_at_most_once_marks_before_sending,
)
from tests.runtime.test_services import (  # noqa: F401
    test_a_long_run_keeps_its_lease_by_renewal,
    test_a_notification_wakes_an_idle_worker_long_before_its_poll,
    test_a_run_that_loses_its_lease_commits_nothing,
    test_a_worker_killed_outright_leaves_no_handler_process_behind,
    test_sigterm_after_the_grace_period_releases_the_lease_for_an_immediate_takeover,
    test_sigterm_lets_a_running_handler_finish_within_the_grace,
)
