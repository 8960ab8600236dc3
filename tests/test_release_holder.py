"""A dead worker process's leases, released by its successor: the run it was
executing when it died (the suspect, if known) is retried unfinished, so in
quarantine; the runs beside it on their first attempt go back pending (the
attempt counted), so their retries are ordinary runs; a run on a later attempt
stays unfinished; without a suspect the holder holds, every run is unfinished."""

import pytest

T = 1_000_000


def died_with_three_runs(inbox):
    """Holder "dead" dies holding a (first attempt), b (a batch of two, first
    attempt) and c (a retry: its first run did not finish)."""
    inbox.ingest("c", "chat", "1", {})
    [first] = inbox.runs.take_runs("old", users=1, now=T)
    assert inbox.runs.release_runs([first], now=T) == ["c"]
    for user, key in (("a", "1"), ("b", "1"), ("b", "2")):
        inbox.ingest(user, "chat", key, {})
    runs = {run.user: run for run in inbox.runs.take_runs("dead", users=5, now=T + 1)}
    assert {u: (r.unfinished, [e.attempts for e in r.events]) for u, r in runs.items()} == {
        "a": (0, [1]), "b": (0, [1, 1]), "c": (1, [2])}
    return runs


def states(inbox):
    return {u: [(e.status, e.attempts) for e in inbox.events(u)] for u in "abc"}


def unfinished_when_taken_again(inbox):
    later = inbox.runs.take_runs("next", users=5, now=T + 10_000)
    return {run.user: run.unfinished for run in later}


def test_only_the_suspect_and_retries_are_unfinished_when_taken_again(inbox):
    runs = died_with_three_runs(inbox)
    released = inbox.runs.release_holder("dead", error="the worker process running it died",
                                    suspect=("a", runs["a"].gen), now=T + 2)
    assert sorted(released) == ["a", "b", "c"]
    assert states(inbox) == {"a": [("running", 1)], "b": [("pending", 1), ("pending", 1)],
                             "c": [("running", 2)]}
    assert {e.error for e in inbox.events("b")} == {"the worker process running it died"}
    assert unfinished_when_taken_again(inbox) == {"a": 1, "b": 0, "c": 1}


@pytest.mark.parametrize("suspect", [None, ("a", 99), ("nobody", 1)])
def test_without_a_suspect_the_holder_holds_every_run_is_unfinished(inbox, suspect):
    died_with_three_runs(inbox)
    released = inbox.runs.release_holder("dead", error="died", suspect=suspect, now=T + 2)
    assert sorted(released) == ["a", "b", "c"]
    assert states(inbox) == {"a": [("running", 1)], "b": [("running", 1), ("running", 1)],
                             "c": [("running", 2)]}
    assert unfinished_when_taken_again(inbox) == {"a": 1, "b": 1, "c": 1}  # a retry alone
