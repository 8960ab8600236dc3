"""Permissions: what `ctx.permit(tool, args)` answers, and the record of every answer.

A rule answers 'allow', 'deny' or 'ask'. The rule that applies to a call is the
first of: the user's rule for the tool, the user's rule for every tool (`*`),
the default rule for the tool, the default rule for every tool; with none,
'deny' (rule `none`: a tool nobody allowed does not run unattended).

'ask' is settled by the approval request `permit:<tool>:<digest of the
arguments>` (store/approvals.py): its answer 'yes' allows, 'no' or its expiry
denies; unanswered, the run ends with that request (handler.ApprovalNeeded)
and the answer comes back as an event.

Invariant: every answer is decided from the rules as committed when the call
is decided (a rule changed while runs are in flight applies to every call
decided after the change commits) and recorded in `permit_decisions` in the
same transaction, only while the asking run's lease is held by its holder in
its generation (a stale run is told LeaseLost, and nothing is recorded).
"""

import hashlib
import json
from typing import Any

import psycopg

from agent_inbox.store import lease, one
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key

ANSWERS = ("allow", "deny", "ask")
DEFAULT_ASK_EXPIRES_IN = 86400


def digest(args: Any) -> str:
    """The arguments' digest: sha256 of their canonical JSON (sorted keys)."""
    text = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def request_id(tool: str, args_digest: str) -> str:
    """The approval request an 'ask' turns into: the same for the same call."""
    return f"permit:{tool}:{args_digest[:32]}"


# The asking run's fence: its lease row FOR SHARE if its holder holds it in
# its generation, unexpired (as a step's record takes it, store/steps.py): a
# takeover either commits first (no row: LeaseLost) or waits for the decision.
HOLD = f"""
SELECT 1 FROM leases l
 WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
   AND {lease.fenced("%(holder)s", "%(gen)s", NOW)}
   FOR SHARE
"""

# The rule that applies, and the answer of its approval request if it asks.
# Reads only.
DECIDE = f"""
WITH rule AS (
    SELECT r.rule, r.answer, r.ask_expires_in FROM (
        SELECT CASE WHEN p.tool = '*' THEN 2 ELSE 1 END AS rank, 'user:' || p.tool AS rule,
               p.answer, p.ask_expires_in
          FROM policies p
         WHERE p.bucket = %(bucket)s AND p.user_id = %(user)s AND p.tool IN (%(tool)s, '*')
         UNION ALL
        SELECT CASE WHEN d.tool = '*' THEN 4 ELSE 3 END, 'default:' || d.tool,
               d.answer, d.ask_expires_in
          FROM default_policies d WHERE d.tool IN (%(tool)s, '*')
         UNION ALL
        SELECT 5, 'none', 'deny', {DEFAULT_ASK_EXPIRES_IN}
    ) r ORDER BY r.rank LIMIT 1
)
SELECT rule.rule, rule.answer, rule.ask_expires_in,
       (SELECT e.payload->>'answer' FROM events e
         WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND e.source = 'approval'
           AND e.source_id = %(request_id)s) AS approval
  FROM rule
"""

RECORD = f"""
INSERT INTO permit_decisions (bucket, user_id, at, tool, args_digest, answer, rule, holder, gen)
VALUES (%(bucket)s, %(user)s, {NOW}, %(tool)s, %(digest)s, %(answer)s, %(rule)s, %(holder)s,
        %(gen)s)
"""


def decide(conn: psycopg.Connection[Any], user: str, holder: str, gen: int, tool: str, args_digest: str,
           now: int | None) -> tuple[str, str, int] | None:
    """(answer, rule, ask_expires_in) for the call, recorded, in the caller's
    transaction (callers decide several users' calls in user order, as leases
    are locked everywhere); None if the run no longer holds its lease (nothing
    recorded).
    The answer is 'allow', 'deny', or 'ask' for an unanswered approval."""
    params = user_key(user, holder=holder, gen=gen, tool=tool, digest=args_digest,
                      request_id=request_id(tool, args_digest), now=now)
    if conn.execute(HOLD, params).fetchone() is None:
        return None
    rule, answer, expires_in, approval = one(conn.execute(DECIDE, params))
    if answer == "ask" and approval is not None:
        answer, rule = ("allow" if approval == "yes" else "deny"), f"{rule} answered {approval}"
    conn.execute(RECORD, {**params, "answer": answer, "rule": rule})
    return answer, rule, expires_in


SET_USER = f"""
INSERT INTO policies AS p (bucket, user_id, tool, answer, ask_expires_in, updated_at, updated_by)
VALUES (%(bucket)s, %(user)s, %(tool)s, %(answer)s, %(ask_expires_in)s, {NOW}, %(actor)s)
    ON CONFLICT ON CONSTRAINT pk_policies DO UPDATE
   SET answer = excluded.answer, ask_expires_in = excluded.ask_expires_in,
       updated_at = excluded.updated_at, updated_by = excluded.updated_by
"""

SET_DEFAULT = f"""
INSERT INTO default_policies AS d (tool, answer, ask_expires_in, updated_at, updated_by)
VALUES (%(tool)s, %(answer)s, %(ask_expires_in)s, {NOW}, %(actor)s)
    ON CONFLICT (tool) DO UPDATE
   SET answer = excluded.answer, ask_expires_in = excluded.ask_expires_in,
       updated_at = excluded.updated_at, updated_by = excluded.updated_by
"""

# An app's default rule (App(policies=...)): stored only if the database has
# no default rule for the tool yet, so an operator's rule wins over the code.
DECLARE_DEFAULT = f"""
INSERT INTO default_policies (tool, answer, ask_expires_in, updated_at, updated_by)
VALUES (%(tool)s, %(answer)s, %(ask_expires_in)s, {NOW}, %(actor)s)
    ON CONFLICT (tool) DO NOTHING
RETURNING 1
"""

CLEAR_USER = """
DELETE FROM policies p WHERE p.bucket = %(bucket)s AND p.user_id = %(user)s AND p.tool = %(tool)s
RETURNING 1
"""
CLEAR_DEFAULT = "DELETE FROM default_policies d WHERE d.tool = %(tool)s RETURNING 1"

LIST_USER = """
SELECT p.tool, p.answer, p.ask_expires_in, p.updated_at, p.updated_by FROM policies p
 WHERE p.bucket = %(bucket)s AND p.user_id = %(user)s ORDER BY p.tool
"""
LIST_DEFAULT = """
SELECT d.tool, d.answer, d.ask_expires_in, d.updated_at, d.updated_by FROM default_policies d
 ORDER BY d.tool
"""

DECISIONS = """
SELECT d.at, d.tool, d.args_digest, d.answer, d.rule, d.holder, d.gen FROM permit_decisions d
 WHERE d.bucket = %(bucket)s AND d.user_id = %(user)s ORDER BY d.id DESC LIMIT %(limit)s
"""

# A rule's change, recorded with the rule it replaced (user '' for a default).
RECORD_CHANGE = f"""
INSERT INTO operator_actions (bucket, user_id, at, actor, action, detail)
VALUES (%(bucket)s, %(user)s, {NOW}, %(actor)s, %(action)s, %(detail)s::jsonb)
"""

POLICY_COLUMNS = ("tool", "answer", "ask_expires_in", "updated_at", "updated_by")


def rules(conn: psycopg.Connection[Any], user: str | None) -> list[dict[str, Any]]:
    """A user's rules (None: the defaults), by tool."""
    statement, params = (LIST_DEFAULT, {}) if user is None else (LIST_USER, user_key(user))
    return [dict(zip(POLICY_COLUMNS, row)) for row in conn.execute(statement, params).fetchall()]


def change(conn: psycopg.Connection[Any], user: str | None, tool: str, answer: str | None, ask_expires_in: int,
           actor: str, now: int | None) -> bool:
    """Set (answer given) or clear (None) a rule, audited; False if a rule to
    clear did not exist."""
    params = user_key(user or "", tool=tool, answer=answer, ask_expires_in=ask_expires_in,
                      actor=actor, now=now)
    before = [r for r in rules(conn, user) if r["tool"] == tool]
    if answer is None:
        if conn.execute(CLEAR_DEFAULT if user is None else CLEAR_USER, params).fetchone() is None:
            return False
    else:
        conn.execute(SET_DEFAULT if user is None else SET_USER, params)
    detail = {"scope": "default" if user is None else "user", "tool": tool,
              "previous": before[0]["answer"] if before else None, "answer": answer,
              "ask_expires_in": ask_expires_in if answer == "ask" else None}
    conn.execute(RECORD_CHANGE, {**params,
                                 "action": "policy_clear" if answer is None else "policy_set",
                                 "detail": json.dumps(detail)})
    return True


def decisions(conn: psycopg.Connection[Any], user: str, limit: int) -> list[dict[str, Any]]:
    keys = ("at", "tool", "args_digest", "answer", "rule", "holder", "gen")
    return [dict(zip(keys, row))
            for row in conn.execute(DECISIONS, user_key(user, limit=limit)).fetchall()]
