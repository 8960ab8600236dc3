"""Bad input gets a specific error naming the argument and value, and nothing is
stored."""

import math

import psycopg
import pytest

from agent_inbox import (AgentInboxError, Inbox, InvalidAnswer, InvalidInput, InvalidPayload,
                         InvalidTime, InvalidTimer, PayloadTooLarge)

T = 1_000_000

CASES = {
    "empty user": (lambda ib: ib.ingest("", "s", "1", {}), InvalidInput, "user must not be empty"),
    "user not a string": (lambda ib: ib.ingest(7, "s", "1", {}), InvalidInput, "user must be a string"),
    "empty source": (lambda ib: ib.ingest("u", "", "1", {}), InvalidInput, "source must not be empty"),
    "empty source_id": (lambda ib: ib.ingest("u", "s", "", {}), InvalidInput, "source_id must not be empty"),
    "empty kind": (lambda ib: ib.ingest("u", "s", "1", {}, kind=""), InvalidInput, "kind must not be empty"),
    "kind not text": (lambda ib: ib.ingest("u", "s", "1", {}, kind=3), InvalidInput, "kind must be a string"),
    "user over 200 bytes": (lambda ib: ib.ingest("u" * 201, "s", "1", {}), InvalidInput,
                            "user is 201 bytes in UTF-8, over the limit of 200"),
    "source over 100 bytes": (lambda ib: ib.ingest("u", "s" * 101, "1", {}), InvalidInput,
                              "source is 101 bytes in UTF-8, over the limit of 100"),
    "source_id over 500 bytes": (lambda ib: ib.ingest("u", "s", "é" * 251, {}), InvalidInput,
                                 "source_id is 502 bytes in UTF-8, over the limit of 500"),
    "12 kB source_id": (lambda ib: ib.ingest("u", "s", "k" * 12_000, {}), InvalidInput,
                        "source_id is 12000 bytes in UTF-8, over the limit of 500"),
    "kind over 200 bytes": (lambda ib: ib.ingest("u", "s", "1", {}, kind="k" * 201), InvalidInput,
                            "kind is 201 bytes in UTF-8, over the limit of 200"),
    "ingest_many source_id over 500 bytes": (
        lambda ib: ib.ingest_many([("u", "s", "ok", {}), ("u", "s", "k" * 501, {})]), InvalidInput,
        "events[1] source_id is 501 bytes in UTF-8, over the limit of 500"),
    "ingest_many user over 200 bytes": (
        lambda ib: ib.ingest_many([("u" * 201, "s", "1", {})]), InvalidInput,
        "events[0] user is 201 bytes"),
    "NUL in source_id": (lambda ib: ib.ingest("u", "s", "a\x00b", {}), InvalidInput, "NUL"),
    "surrogate in user": (lambda ib: ib.ingest("\ud800", "s", "1", {}), InvalidInput, "lone surrogate"),
    "surrogate in payload": (lambda ib: ib.ingest("u", "s", "1", {"a": "\ud800"}), InvalidPayload,
                             "lone surrogate"),
    "payload not JSON": (lambda ib: ib.ingest("u", "s", "1", {"when": object()}), InvalidPayload,
                         "not JSON-serialisable"),
    "payload NaN": (lambda ib: ib.ingest("u", "s", "1", {"x": math.nan}), InvalidPayload,
                    "not JSON-serialisable"),
    "payload NUL": (lambda ib: ib.ingest("u", "s", "1", {"x": "\x00"}), InvalidPayload, "NUL"),
    "payload too large": (lambda ib: ib.ingest("u", "s", "1", {"x": "a" * (1 << 20)}),
                          PayloadTooLarge, "over the limit of 1048576"),
    "now negative": (lambda ib: ib.acquire("u", "A", now=-1), InvalidTime, "now must not be negative"),
    "now float": (lambda ib: ib.acquire("u", "A", now=1.5), InvalidTime, "whole number of seconds"),
    "now bool": (lambda ib: ib.acquire("u", "A", now=True), InvalidTime, "whole number of seconds"),
    "now string": (lambda ib: ib.claim_batch("u", "A", 1, now="10"), InvalidTime, "(got '10')"),
    "gen zero": (lambda ib: ib.claim_batch("u", "A", 0, now=T), InvalidInput, "gen must be a positive integer"),
    "gen float": (lambda ib: ib.finish("u", "A", 1.0, [], now=T), InvalidInput, "gen must be a positive integer"),
    "ids not a list": (lambda ib: ib.finish("u", "A", 1, 5, now=T), InvalidInput, "ids must be a list"),
    "ids with a string": (lambda ib: ib.finish("u", "A", 1, ["1"], now=T), InvalidInput, "ids item"),
    "messages a string": (lambda ib: ib.finish("u", "A", 1, [], messages="hi", now=T), InvalidInput,
                          "not a single value"),
    "empty message": (lambda ib: ib.finish("u", "A", 1, [], messages=[""], now=T), InvalidInput,
                      "messages item must not be empty"),
    "due negative": (lambda ib: ib.add_timer("u", "t", -5, {}), InvalidTime, "due must not be negative"),
    "due float": (lambda ib: ib.add_timer("u", "t", 1.5, {}), InvalidTime, "due must be a whole number"),
    "due past 9999": (lambda ib: ib.add_timer("u", "t", 2**62, {}), InvalidTime, "the year 9999"),
    "every past 9999": (lambda ib: ib.add_timer("u", "t", T, {}, every=2**62), InvalidTime,
                        "the year 9999"),
    "cron never again": (lambda ib: ib.add_timer("u", "t", 253_402_300_000, {}, cron="0 0 1 1 *"),
                         InvalidTimer, "no occurrence after"),
    "expires_in past 9999": (lambda ib: ib.request_approval("u", "r", expires_in=2**62, action="x",
                                                            now=T), InvalidTime, "the year 9999"),
    "every zero": (lambda ib: ib.add_timer("u", "t", T, {}, every=0), InvalidInput,
                   "every must be a positive integer"),
    "every negative": (lambda ib: ib.add_timer("u", "t", T, {}, every=-60), InvalidInput,
                       "every must be a positive integer"),
    "catch_up_limit huge": (lambda ib: ib.add_timer("u", "t", T, {}, every=60, missed="catch_up",
                                                   catch_up_limit=2**31), InvalidTimer,
                            "catch_up_limit must be at most 10000"),
    "fixed key on recurring": (lambda ib: ib.add_timer("u", "t", T, {}, every=60, key=("a", "b")),
                               InvalidTimer, "cannot be fixed on a recurring timer"),
    "key not a pair": (lambda ib: ib.add_timer("u", "t", T, {}, key=("a",)), InvalidTimer,
                       "(source, source_id) pair"),
    "timer payload not a mapping": (lambda ib: ib.add_timer("u", "t", T, [1]), InvalidPayload,
                                    "must be a mapping"),
    "expires_in negative": (lambda ib: ib.request_approval("u", "r", expires_in=-1, action="x", now=T),
                            InvalidTime, "expires_in must not be negative"),
    "action not JSON": (lambda ib: ib.request_approval("u", "r", expires_in=60, action={1, 2}, now=T),
                        InvalidPayload, "not JSON-serialisable"),
    "answer maybe": (lambda ib: ib.answer_approval("u", "r", "maybe", now=T), InvalidAnswer,
                     "answer must be 'yes' or 'no' (got 'maybe')"),
    "answer Yes": (lambda ib: ib.answer_approval("u", "r", "Yes", now=T), InvalidAnswer, "'yes' or 'no'"),
    "send not callable": (lambda ib: ib.dispatch("u", None, now=T), InvalidInput, "send must be callable"),
    "status unknown": (lambda ib: ib.events("u", status="finished"), InvalidInput, "status must be one of"),
    "repair pairs a string": (lambda ib: ib.repair_dead("u", requeue=True, actor="ops"),
                              InvalidInput, "pairs must be a list"),
    "repair pair of one": (lambda ib: ib.repair_dead([("u",)], requeue=True, actor="ops"),
                           InvalidInput, "pairs[0] must be a (user, event id) pair"),
    "repair id a string": (lambda ib: ib.repair_dead([("u", "7")], requeue=False, actor="ops"),
                           InvalidInput, "pairs[0] id must be a positive integer"),
    "repair no actor": (lambda ib: ib.repair_dead([("u", 7)], requeue=True, actor=""),
                        InvalidInput, "actor must not be empty"),
    "repair batches a string": (lambda ib: ib.repair_failed_batches("7", retry=True, actor="ops"),
                                InvalidInput, "batches must be a list"),
}


def _row_counts(url):
    with psycopg.connect(url) as conn:
        return [conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("events", "leases", "timers", "outbox")]


@pytest.mark.parametrize("call, error, message", CASES.values(), ids=CASES.keys())
def test_bad_input_is_refused_with_a_specific_error_and_nothing_stored(
        inbox, database_url, call, error, message):
    before = _row_counts(database_url)
    with pytest.raises(error) as raised:
        call(inbox)
    assert message in str(raised.value)
    assert isinstance(raised.value, AgentInboxError) and isinstance(raised.value, ValueError)
    assert _row_counts(database_url) == before


def test_the_payload_limit_is_configurable(make_inbox):
    small = make_inbox(max_payload_bytes=100)
    assert small.ingest("u", "s", "ok", {"x": "a" * 50})
    with pytest.raises(PayloadTooLarge, match="over the limit of 100"):
        small.ingest("u", "s", "big", {"x": "a" * 200})


def test_names_and_keys_at_their_limits_are_stored(inbox):
    assert inbox.ingest("u" * 200, "s" * 100, "é" * 250, {}, kind="k" * 200)
    assert inbox.ingest_many([("u" * 200, "s" * 100, "k" * 500, {}, "k" * 200)]) == [True]


def test_bad_configuration_is_refused(database_url):
    with pytest.raises(InvalidInput, match="lease_ttl must be a positive integer"):
        Inbox.connect(database_url, lease_ttl=0)


def test_a_value_postgresql_refuses_is_refused_not_unavailable(inbox):
    """A user name too long for the lease index (no API limit on acquire) is a
    DatabaseRefused naming PostgreSQL's code, not DatabaseUnavailable: retrying
    it can never succeed."""
    from agent_inbox import DatabaseRefused

    with pytest.raises(DatabaseRefused) as refused:
        inbox.acquire("u" * 9000 + "".join(chr(0x4e00 + i) for i in range(3000)), "w")
    assert refused.value.sqlstate == "54000"
