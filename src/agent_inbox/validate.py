"""Argument checks run before any SQL, so bad input stores nothing.

Each function returns the value in the form the store wants, or raises a
specific `errors.InvalidInput` naming the argument and the value given.
"""

import json
from collections.abc import Iterable, Mapping

from agent_inbox import errors

# PostgreSQL's bigint: times, durations and ids must fit.
_BIGINT_MAX = 2**63 - 1
# Times and durations stop at the end of year 9999: far enough for any schedule,
# and sums of two of them (due + every, now + expires_in) stay inside a bigint.
MAX_SECONDS = 253_402_300_799
# Longest names and keys of an event, in UTF-8 bytes. (user_id, source, source_id)
# is a unique btree, whose entries PostgreSQL caps at about 2.7 kB: keys past that
# would fail in the database, for ever, instead of here.
MAX_USER_BYTES = 200
MAX_SOURCE_BYTES = 100
MAX_SOURCE_ID_BYTES = 500
MAX_KIND_BYTES = 200


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text(field: str, value: object, max_bytes: int | None = None) -> str:
    """A non-empty string PostgreSQL can store (text cannot hold NUL), of at
    most `max_bytes` bytes in UTF-8 if given."""
    if not isinstance(value, str):
        raise errors.InvalidInput(field, value, "must be a string")
    if not value:
        raise errors.InvalidInput(field, value, "must not be empty")
    if "\x00" in value:
        raise errors.InvalidInput(field, value, "must not contain NUL characters")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise errors.InvalidInput(field, value, "contains a lone surrogate (not valid Unicode)") from None
    if max_bytes is not None and size > max_bytes:
        raise errors.InvalidInput(field, value,
                                  f"is {size} bytes in UTF-8, over the limit of {max_bytes}")
    return value


def event_names(field: str, user: object, source: object, source_id: object,
                kind: object = None) -> tuple[str, str, str, str | None]:
    """An event's user, source, source_id and kind, each within its limit."""
    prefix = f"{field} " if field else ""
    return (text(prefix + "user", user, MAX_USER_BYTES),
            text(prefix + "source", source, MAX_SOURCE_BYTES),
            text(prefix + "source_id", source_id, MAX_SOURCE_ID_BYTES),
            None if kind is None else text(prefix + "kind", kind, MAX_KIND_BYTES))


def epoch(field: str, value: object) -> int:
    """A time or duration: a whole, non-negative number of seconds."""
    if not _is_int(value):
        raise errors.InvalidTime(field, value, "must be a whole number of seconds (int)")
    if value < 0:
        raise errors.InvalidTime(field, value, "must not be negative")
    if value > MAX_SECONDS:
        raise errors.InvalidTime(field, value, f"is too large (at most {MAX_SECONDS}, the year 9999)")
    return value


def optional_text(field: str, value: object) -> str | None:
    return None if value is None else text(field, value)


def optional_epoch(field: str, value: object) -> int | None:
    return None if value is None else epoch(field, value)


def positive_int(field: str, value: object) -> int:
    if not _is_int(value) or value <= 0 or value > _BIGINT_MAX:
        raise errors.InvalidInput(field, value, "must be a positive integer")
    return value


def positive_seconds(field: str, value: object) -> int:
    """A duration that must be at least one second (a timer's period)."""
    if not _is_int(value) or value <= 0:
        raise errors.InvalidInput(field, value, "must be a positive integer")
    return epoch(field, value)


def sequence(field: str, values: object) -> list:
    """A list of items, not a single string or value mistaken for one."""
    if values is None or isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise errors.InvalidInput(field, values, "must be a list or tuple of items")
    return list(values)


def ids(field: str, values: object) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise errors.InvalidInput(field, values, "must be a list of event ids")
    result = [positive_int(f"{field} item", v) for v in values]
    return sorted(set(result))


def messages(field: str, values: object) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise errors.InvalidInput(field, values, "must be a list of strings, not a single value")
    return [text(f"{field} item", v) for v in values]


def payload(field: str, value: object, limit: int) -> str:
    """Encode as JSON text, within `limit` bytes; PostgreSQL's jsonb refuses NaN,
    Infinity and the NUL character, so they are refused here first."""
    try:
        encoded = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise errors.InvalidPayload(field, value, f"is not JSON-serialisable: {exc}") from None
    if "\\u0000" in encoded:
        raise errors.InvalidPayload(field, value, "must not contain the NUL character")
    try:
        size = len(encoded.encode("utf-8"))
    except UnicodeEncodeError:
        raise errors.InvalidPayload(field, value, "contains a lone surrogate (not valid Unicode)") from None
    if size > limit:
        raise errors.PayloadTooLarge(
            field, f"<{size} bytes>", f"is {size} bytes as JSON, over the limit of {limit}"
        )
    return encoded


def mapping_payload(field: str, value: object, limit: int) -> str:
    """A JSON object: timers add scheduled_for, late_by and skipped to it."""
    if not isinstance(value, Mapping):
        raise errors.InvalidPayload(field, value, "must be a mapping (a JSON object)")
    return payload(field, dict(value), limit)


def event_key(field: str, value: object) -> tuple[str, str]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise errors.InvalidTimer(field, value, "must be a (source, source_id) pair")
    return text(f"{field} source", value[0]), text(f"{field} source_id", value[1])


def answer(field: str, value: object) -> str:
    if value not in ("yes", "no"):
        raise errors.InvalidAnswer(field, value, "must be 'yes' or 'no'")
    return value


def boolean(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise errors.InvalidInput(field, value, "must be True or False")
    return value
