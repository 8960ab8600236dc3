"""A user's memory on Citus: tests/test_memory.py's functions against this
folder's cluster (the memory table distributed by bucket, co-located with the
user's lease: read with the claim, written in the finish, on the user's node)."""

from tests.test_memory import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_a_run_reads_the_memory_its_predecessor_left,
    test_a_stale_or_failed_run_never_writes_memory,
    test_an_operator_changes_memory_only_while_no_run_holds_the_lease,
    test_an_operators_change_is_seen_by_the_next_run_not_overwritten,
    test_memory_comes_with_every_users_claim_in_one_take,
    test_memory_over_the_limit_is_refused_and_nothing_commits,
)
