"""The race tests of tests/test_concurrency.py, every racer's Inbox going
through PgBouncer in transaction mode (see conftest.py): each guarantee holds
when consecutive transactions of one client run on different server
connections. The lock holder and the pg_stat_activity probe stay direct.
"""

from tests.test_concurrency import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_deadlock_is_retried_by_in_transaction,
    test_answer_racing_the_expiry_timer_has_one_outcome,
    test_concurrent_schedulers_over_many_batches_fire_each_timer_once,
    test_dispatchers_looping_over_many_users_send_each_message_once,
    test_dispatchers_of_one_user_send_each_message_once,
    test_simultaneous_first_acquires_give_exactly_one_lease,
    test_simultaneous_ingests_of_one_key_store_it_once,
    test_simultaneous_schedulers_fire_each_occurrence_once,
    test_stale_holders_finish_racing_a_takeover_is_refused,
    test_two_answers_racing_are_told_the_same_answer,
)

# A racer waiting on a lock holds a server connection (its transaction is
# open), and races.wait_for_lock_waiters needs every racer waiting at once: the
# widest race (16 first acquires) needs 16. The lock holder and the probe are
# direct connections and take none.
POOL_SIZE = 16
