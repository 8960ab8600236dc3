"""Permissions, the Inbox's side (mixed into `agent_inbox.Inbox`): the rules,
their changes, and the decisions the worker's completer asks for every run in
flight at once. What a handler's `ctx.permit` sees is agent/permits.py; the
rules and their invariant are store/policies.py.
"""

import asyncio

from agent_inbox import db, validate
from agent_inbox.agent.permits import (MAX_TOOL_BYTES, Decision, PermitAsk, RunPermits,
                                       check_answer)
from agent_inbox.store import policies


class Permissions:
    """Mixed into `agent_inbox.Inbox`: the rules, their changes, the decisions."""

    def set_policy(self, tool: str, answer: str, *, user: str | None = None,
                   ask_expires_in: int = policies.DEFAULT_ASK_EXPIRES_IN, actor: str,
                   now: int | None = None) -> None:
        """Set the rule for `tool` ('*': every tool) of `user`, or the default
        rule (user None): 'allow', 'deny' or 'ask' (an approval request that
        waits `ask_expires_in` seconds). Audited; applies to every call decided
        after it commits."""
        tool = validate.text("tool", tool, MAX_TOOL_BYTES)
        answer = check_answer(answer)
        user = None if user is None else validate.text("user", user)
        ask_expires_in = validate.positive_int("ask_expires_in", ask_expires_in)
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            policies.change(conn, user, tool, answer, ask_expires_in, actor, now)

    def clear_policy(self, tool: str, *, user: str | None = None, actor: str,
                     now: int | None = None) -> bool:
        """Remove a rule (audited); False if there was none."""
        tool = validate.text("tool", tool, MAX_TOOL_BYTES)
        user = None if user is None else validate.text("user", user)
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return policies.change(conn, user, tool, None, policies.DEFAULT_ASK_EXPIRES_IN,
                                   actor, now)

    def declare_policies(self, rules: dict[str, str], *, actor: str = "app") -> list[str]:
        """An app's default rules (tool -> answer), each stored only where the
        database has no default rule for that tool yet (an operator's wins);
        the tools stored."""
        checked = {validate.text("tool", tool, MAX_TOOL_BYTES): check_answer(answer)
                   for tool, answer in rules.items()}
        stored = []
        with db.transaction(self._pool) as conn:
            for tool, answer in sorted(checked.items()):
                if conn.execute(policies.DECLARE_DEFAULT, {
                        "tool": tool, "answer": answer, "actor": actor, "now": None,
                        "ask_expires_in": policies.DEFAULT_ASK_EXPIRES_IN}).fetchone():
                    stored.append(tool)
        return stored

    def policies(self, user: str | None = None) -> list[dict]:
        """A user's rules (None: the default rules), by tool."""
        user = None if user is None else validate.text("user", user)
        with db.connection(self._pool) as conn:
            return policies.rules(conn, user)

    def permit_decisions(self, user: str, *, limit: int = 100) -> list[dict]:
        """The answers given to a user's runs, newest first."""
        user = validate.text("user", user)
        limit = validate.positive_int("limit", limit)
        with db.connection(self._pool) as conn:
            return policies.decisions(conn, user, limit)

    def decide_permits(self, asks: list[PermitAsk], *,
                       now: int | None = None) -> list[Decision | None]:
        """Decide and record runs' permit calls in one transaction (on Citus one
        per bucket), a Decision each, or None where the run's lease is lost. On
        Citus a bucket whose node does not answer is left undone: PartlyDone
        (`done`: the answers; `unknown`: the indices of the asks left undone)."""
        now = validate.optional_epoch("now", now)

        def decide(conn, group: list[PermitAsk]) -> list[Decision | None]:
            answers: dict[int, Decision | None] = {}
            for k in sorted(range(len(group)), key=lambda k: group[k].user):  # locks in order
                a = group[k]
                answer = policies.decide(conn, a.user, a.holder, a.gen, a.tool, a.args_digest,
                                         now)
                answers[k] = None if answer is None else Decision(*answer)
            return [answers[k] for k in range(len(group))]
        return self._path.in_groups(asks, lambda ask: ask.user, decide)

    def _direct_permits(self, user: str, holder: str, gen: int) -> RunPermits:
        """`ctx.permit` through this Inbox: one transaction per call."""
        def ask(question: PermitAsk) -> Decision | None:
            return self.decide_permits([question])[0]

        async def ask_async(question: PermitAsk) -> Decision | None:
            return await asyncio.to_thread(ask, question)

        return RunPermits(user, holder, gen, ask, ask_async)
