"""A user's memory through PgBouncer in transaction mode: tests/test_memory.py's
functions with every Inbox behind it."""

from tests.test_memory import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_run_reads_the_memory_its_predecessor_left,
    test_a_stale_or_failed_run_never_writes_memory,
    test_an_operator_changes_memory_only_while_no_run_holds_the_lease,
    test_memory_comes_with_every_users_claim_in_one_take,
)
