"""Permissions through PgBouncer in transaction mode: tests/test_permissions.py's
functions with every Inbox behind it."""

from tests.test_permissions import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_rule_changed_while_a_run_is_in_flight_applies_to_calls_after_the_commit,
    test_a_stale_run_is_refused_and_nothing_is_recorded,
    test_ask_ends_the_run_with_an_approval_and_its_answer_decides_the_next_call,
    test_the_users_rule_then_the_default_then_deny,
)
