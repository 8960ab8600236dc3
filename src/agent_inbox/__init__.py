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
)
from agent_inbox.inbox import Inbox
from agent_inbox.records import Event, Lease, OutboxMessage, Timer

__all__ = [
    "AgentInboxError", "DatabaseUnavailable", "Event", "Inbox", "InvalidAnswer", "InvalidInput",
    "InvalidPayload", "InvalidTime", "InvalidTimer", "Lease", "OutboxMessage", "PayloadTooLarge",
    "SchemaNotAtHead", "Timer",
]
