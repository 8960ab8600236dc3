"""What an Inbox is configured with, checked once, shared by its parts.

`Inbox` hands one `Settings` (and its pool and run path) to each typed object
it holds (`Runs`, `Delivery`, `Scheduling`): they share no other state, so
nothing passes between them by convention.
"""

from dataclasses import dataclass

from agent_inbox import validate
from agent_inbox.records import ClaimPolicy, SendPolicy

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
# A user's memory is read with every claim: kept small by default.
DEFAULT_MAX_MEMORY_BYTES = 256 << 10


@dataclass(frozen=True)
class Settings:
    """An Inbox's limits and policies (see `Inbox.connect` for each default)."""

    claim: ClaimPolicy
    lease_ttl: int
    outbox_gap: int
    send: SendPolicy
    max_payload_bytes: int
    max_memory_bytes: int

    @classmethod
    def checked(cls, *, max_attempts: int = 3, lease_ttl: int = 120, outbox_gap: int = 3600,
                max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
                retry_backoff: int = 5, retry_backoff_cap: int = 300, max_batch: int = 100,
                send_timeout: int = 120, max_send_attempts: int = 10, send_backoff: int = 5,
                send_backoff_cap: int = 300) -> "Settings":
        """The Inbox constructor's options, each checked (InvalidInput names
        the first that is wrong)."""
        return cls(
            claim=ClaimPolicy(
                max_attempts=validate.positive_int("max_attempts", max_attempts),
                backoff_base=validate.epoch("retry_backoff", retry_backoff),
                backoff_cap=validate.epoch("retry_backoff_cap", retry_backoff_cap),
                max_batch=validate.positive_int("max_batch", max_batch)),
            lease_ttl=validate.positive_int("lease_ttl", lease_ttl),
            outbox_gap=validate.epoch("outbox_gap", outbox_gap),
            send=SendPolicy(
                timeout=validate.positive_int("send_timeout", send_timeout),
                max_attempts=validate.positive_int("max_send_attempts", max_send_attempts),
                backoff_base=validate.epoch("send_backoff", send_backoff),
                backoff_cap=validate.epoch("send_backoff_cap", send_backoff_cap)),
            max_payload_bytes=validate.positive_int("max_payload_bytes", max_payload_bytes),
            max_memory_bytes=validate.positive_int("max_memory_bytes", max_memory_bytes))
