"""agent-inbox: a durable per-user inbox for always-on agents, on PostgreSQL.

    from agent_inbox import Inbox
    with Inbox.connect(url) as inbox:
        inbox.ingest("alice", "github", delivery_id, payload)

Names are imported on first use, so a quarantine process whose handler needs
only `Result` does not pay for the database client.
"""

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "agent_inbox.errors": [
        "AgentInboxError", "DatabaseRefused", "DatabaseUnavailable", "InvalidAnswer",
        "InvalidInput", "InvalidPayload", "InvalidTime", "InvalidTimer", "PartlyDone",
        "PayloadTooLarge", "PermanentSendError", "SchemaNotAtHead", "StepMismatch", "StepRefused",
        "TransactionConflict", "LeaseLost", "UserBusy",
    ],
    "agent_inbox.agent.app": ["App", "Limit"],
    "agent_inbox.agent.handler": ["Context"],
    "agent_inbox.agent.permits": ["ApprovalNeeded", "Permit"],
    "agent_inbox.api.inbox": ["Inbox"],
    "agent_inbox.api.async_inbox": ["AsyncInbox"],
    "agent_inbox.api.runs": ["Run"],
    "agent_inbox.records": ["Approval", "Event", "Lease", "OutboxMessage", "Timer"],
    "agent_inbox.agent.result": ["ApprovalRequest", "Message", "Result", "TimerRequest"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_inbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from agent_inbox.errors import (AgentInboxError, DatabaseRefused, DatabaseUnavailable,
                                    InvalidAnswer, InvalidInput, InvalidPayload, InvalidTime,
                                    InvalidTimer, PartlyDone, PayloadTooLarge,
                                    PermanentSendError, SchemaNotAtHead, StepMismatch,
                                    StepRefused, TransactionConflict, LeaseLost, UserBusy)
    from agent_inbox.agent.app import App, Limit
    from agent_inbox.agent.handler import Context
    from agent_inbox.agent.permits import ApprovalNeeded, Permit
    from agent_inbox.api.async_inbox import AsyncInbox
    from agent_inbox.api.inbox import Inbox
    from agent_inbox.records import Approval, Event, Lease, OutboxMessage, Timer
    from agent_inbox.agent.result import ApprovalRequest, Message, Result, TimerRequest
    from agent_inbox.api.runs import Run
