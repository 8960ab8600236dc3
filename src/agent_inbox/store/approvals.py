"""Approvals: the answer and the expiry race under one inbox key.

A request is a one-off timer `expire:<request_id>` whose event key is
('approval', request_id). An answer is stored under that same key, so whichever
of the answer and the expiry is inserted first stands and the other is a
duplicate. The deadline is checked in the answer's own statement against the
database clock: past it, the expiry is stored even if no scheduler has run.
"""

from agent_inbox.db import Queries, Query
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key


def expiry_timer_id(request_id: str) -> str:
    return f"expire:{request_id}"


# Store the answer, or the expiry once the deadline has passed; nothing if the
# request is unknown or an answer already stands. Reports whether it is known.
ANSWER = f"""
WITH request AS (
    SELECT due, payload FROM timers
     WHERE bucket = %(bucket)s AND user_id = %(user)s AND timer_id = %(timer_id)s
), stored AS (
    INSERT INTO events (bucket, user_id, source, source_id, payload)
    SELECT %(bucket)s, %(user)s, 'approval', %(request_id)s,
           CASE WHEN {NOW} >= r.due THEN r.payload
                ELSE jsonb_build_object('approval', %(request_id)s::text, 'answer', %(answer)s::text)
           END
      FROM request r
        ON CONFLICT ON CONSTRAINT uq_events_user_id_source_source_id DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM request)
"""

# The answer that stands, after a conflicting insert committed first.
STANDING = """
SELECT payload->>'answer' FROM events
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND source = 'approval'
   AND source_id = %(request_id)s
"""


def answer(user: str, request_id: str, answer: str, now: int | None) -> Queries[str]:
    """In the caller's transaction: the answer that stands ('unknown': no
    such request)."""
    params = user_key(user, request_id=request_id, answer=answer, now=now,
                      timer_id=expiry_timer_id(request_id))
    while True:
        [(known,)] = yield Query(ANSWER, params)
        if not known:
            return "unknown"
        standing = yield from standing_answer(user, request_id)
        if standing is not None:  # else an operator deleted it in between: store again
            return standing


def standing_answer(user: str, request_id: str) -> Queries[str | None]:
    rows = yield Query(STANDING, user_key(user, request_id=request_id))
    return rows[0][0] if rows else None
