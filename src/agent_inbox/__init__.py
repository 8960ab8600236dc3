"""agent-inbox: a durable per-user inbox for always-on agents, on PostgreSQL.

    from agent_inbox import Inbox
    with Inbox.connect(url) as inbox:
        inbox.ingest("alice", "github", delivery_id, payload)
"""

from agent_inbox.errors import (
    AgentInboxError,
    DatabaseUnavailable,
    InvalidAnswer,
    InvalidInput,
    InvalidPayload,
    InvalidTime,
    InvalidTimer,
    PayloadTooLarge,
    SchemaNotAtHead,
    TransactionConflict,
)
from agent_inbox.handler import Context
from agent_inbox.inbox import Inbox, Run
from agent_inbox.records import Event, Lease, OutboxMessage, Timer
from agent_inbox.result import ApprovalRequest, Message, Result, TimerRequest

__all__ = [
    "AgentInboxError", "ApprovalRequest", "Context", "DatabaseUnavailable", "Event", "Inbox",
    "InvalidAnswer", "InvalidInput", "InvalidPayload", "InvalidTime", "InvalidTimer", "Lease",
    "Message", "OutboxMessage", "PayloadTooLarge", "Result", "Run", "SchemaNotAtHead", "Timer", "TransactionConflict",
    "TimerRequest",
]
