"""Limits shared by the fleet through PgBouncer in transaction mode:
tests/test_limits.py's functions, every limiter's grant through the pooler (one
autocommit statement: no session state, no prepared statement)."""

from tests.test_limits import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_caller_that_gives_up_leaves_the_line,
    test_a_change_by_limits_set_reaches_a_running_limiter,
    test_a_context_calls_its_limiter_in_async_and_plain_handlers,
    test_bad_input_gets_a_clear_error_and_changes_nothing,
    test_callers_are_served_in_arrival_order,
    test_declare_makes_a_default_that_an_operator_change_wins_over,
    test_limiters_of_several_processes_never_take_more_than_the_bucket,
    test_the_cli_refuses_bad_limits_and_lists_what_stands,
)
