"""The operator CLI on the Citus cluster (the single-server tests, run here
unchanged): views with no user named read every shard, locking nothing;
repairs find their users first and lock per bucket."""

from tests.test_operator_cli import (  # noqa: F401 -- collected here, under this folder's fixtures
    test_approve_shows_the_standing_answer,
    test_bad_input_exits_2_and_changes_nothing,
    test_dead_list_across_users,
    test_discard_deletes_only_dead_events,
    test_events_lists_a_users_events_newest_first,
    test_json_escapes_c1_and_bidi_characters_and_stays_exact,
    test_prune_deletes_old_done_events_and_keeps_recent_keys,
    test_requeue_and_discard_work_in_chunks,
    test_requeue_does_not_disturb_a_run_in_progress,
    test_requeue_makes_dead_events_claimable_and_leaves_others_alone,
    test_requeue_rechecks_dead_once_the_row_is_locked,
    test_requeue_with_a_user_filter_leaves_other_users_alone,
    test_status_counts_match_the_inbox,
    test_tables_escape_control_characters,
    test_timers_show_due_and_next_due,
    world,
)
