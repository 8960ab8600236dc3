"""The race tests of tests/test_concurrency.py on the Citus cluster: the
lock holder is routed to the user's node, and the probe that waits for the
racers reads citus_stat_activity, where their waits on the worker nodes show.
"""

from tests.test_concurrency import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_answer_racing_the_expiry_timer_has_one_outcome,
    test_concurrent_schedulers_over_many_batches_fire_each_timer_once,
    test_simultaneous_schedulers_fire_each_occurrence_once,
    test_two_answers_racing_are_told_the_same_answer,
    test_dispatchers_looping_over_many_users_send_each_message_once,
    test_dispatchers_of_one_user_send_each_message_once,
    test_simultaneous_first_acquires_give_exactly_one_lease,
    test_simultaneous_ingests_of_one_key_store_it_once,
    test_stale_holders_finish_racing_a_takeover_is_refused,
)
