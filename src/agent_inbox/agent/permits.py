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

import enum
from dataclasses import dataclass
from typing import Any, Callable

from agent_inbox import errors, validate
from agent_inbox.agent.result import ApprovalRequest
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
