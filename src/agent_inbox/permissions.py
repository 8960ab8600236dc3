"""Permissions: `await ctx.permit(tool, args)` decides whether a tool call may
run unattended (store/policies.py has the rules and the invariant).

- 'allow' and 'deny' are returned (`Permit.ALLOW`, `Permit.DENY`, a `str` enum).
- 'ask', while its approval request is unanswered, raises `ApprovalNeeded`:
  the run ends there, successfully, with that approval request
  (`Result(approvals=[...])`, committed by its fenced finish); the answer, or
  the expiry, comes back as an event ('approval', request id) whose payload
  names the tool and arguments, and the agent's next `ctx.permit` of the same
  call gets 'allow' (yes) or 'deny' (no, expired). `ApprovalNeeded` is a
  BaseException, so a handler's `except Exception` does not swallow it; a
  handler that wants to keep what the run learned catches it and returns
  `Result(approvals=[exc.request], memory=...)` itself.
- A run whose lease is gone is told `LeaseLost`, and its call is not recorded.

Where the question goes is the run's asker: the worker's (its completer
decides the calls of every run in flight together) or an Inbox's own
(`Inbox.context`).
"""

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Callable

from agent_inbox import db, errors, validate
from agent_inbox.result import ApprovalRequest
from agent_inbox.store import policies

MAX_TOOL_BYTES = 200


class Permit(str, enum.Enum):
    ALLOW = "allow"
    DENY = "deny"


class ApprovalNeeded(BaseException):
    """A rule asks and nobody has answered: the run ends with `request`."""

    def __init__(self, request: ApprovalRequest):
        super().__init__(f"approval needed: {request.request_id}")
        self.request = request


@dataclass(frozen=True)
class PermitAsk:
    """One call's question, as a run asks it."""

    user: str
    holder: str
    gen: int
    tool: str
    args_digest: str


@dataclass(frozen=True)
class Decision:
    answer: str  # 'allow', 'deny' or 'ask'
    rule: str
    ask_expires_in: int


class RunPermits:
    """One run's `ctx.permit`: checks the call, asks (`asker`: a PermitAsk to
    its Decision, or None when the lease is lost) and turns the answer into a
    Permit or ApprovalNeeded."""

    def __init__(self, user: str, holder: str, gen: int, asker: Callable, async_asker: Callable):
        self.user, self.holder, self.gen = user, holder, gen
        self._asker, self._async_asker = asker, async_asker

    def _question(self, tool: object, args: Any) -> PermitAsk:
        tool = validate.text("tool", tool, MAX_TOOL_BYTES)
        try:
            digest = policies.digest(args)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidInput("args", args, f"must be JSON-serialisable: {exc}") from None
        return PermitAsk(self.user, self.holder, self.gen, tool, digest)

    def _answer(self, ask: PermitAsk, args: Any, decision: Decision | None) -> Permit:
        if decision is None:
            raise errors.LeaseLost(f"ctx.permit({ask.tool!r}) of user={self.user} gen={self.gen} "
                                   "refused: the run's lease is lost")
        if decision.answer == "ask":
            raise ApprovalNeeded(ApprovalRequest(
                policies.request_id(ask.tool, ask.args_digest), decision.ask_expires_in,
                {"tool": ask.tool, "args": args, "rule": decision.rule}))
        return Permit(decision.answer)

    def decide(self, question: PermitAsk) -> Decision | None:
        """The decision for a checked question (a quarantine process's, asked
        over its pipe, is decided here in the worker)."""
        return self._asker(question)

    def ask(self, tool: str, args: Any) -> Permit:
        question = self._question(tool, args)
        return self._answer(question, args, self._asker(question))

    async def ask_async(self, tool: str, args: Any) -> Permit:
        question = self._question(tool, args)
        return self._answer(question, args, await self._async_asker(question))


def check_answer(answer: object) -> str:
    if answer not in policies.ANSWERS:
        raise errors.InvalidInput("answer", answer, f"must be one of {', '.join(policies.ANSWERS)}")
    return answer


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
