"""Webhook signature checks: pure functions, no I/O, no clock of their own.

Invariant: a check answers True only if the signature is an HMAC-SHA256 of the
exact raw body (for Stripe, of "<t>.<raw body>"; for Slack, of
"v0:<t>:<raw body>"; for Standard Webhooks, of "<id>.<t>.<raw body>"; t inside
the tolerance) under the given secret; digests are compared in constant time
(`hmac.compare_digest`), and malformed input answers False, never raises.

The `*_any` checks take several keys (a secret being rotated): every key is
tried and every signature compared, with no early exit, so the time taken does
not say which one matched.
"""

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII digits only; 18 keeps it inside int64
# Stripe sends one or two v1 entries; a cap keeps a hostile header from
# costing more than a few comparisons.
MAX_STRIPE_SIGNATURES = 8
# Standard Webhooks sends one signature, two while the sender rotates its secret.
MAX_STANDARD_SIGNATURES = 8
# Both Standard Webhooks and Slack specify five minutes, either way.
STANDARD_TOLERANCE = 300
SLACK_TOLERANCE = 300
_BASE64 = re.compile(r"[A-Za-z0-9+/]*")
STANDARD_SECRET_PREFIX = "whsec_"


def _key(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


def _digest(secret: str | bytes, message: bytes) -> bytes:
    return hmac.new(_key(secret), message, hashlib.sha256).digest()


def _hex_matches(expected: bytes, given: str) -> bool:
    """Constant-time comparison of a digest with a hex string (either case)."""
    if not _SHA256_HEX.fullmatch(given):
        return False
    return hmac.compare_digest(expected, bytes.fromhex(given))


def _prefixed_matches(expected: bytes, header: str | None) -> bool:
    """`header` is "sha256=<hex>" of the digest `expected`."""
    if not header:
        return False
    scheme, sep, value = header.strip().partition("=")
    if not sep or scheme.strip().lower() != "sha256":
        return False
    return _hex_matches(expected, value.strip())


def _prefixed_sha256(secret: str | bytes, body: bytes, header: str | None) -> bool:
    return _prefixed_matches(_digest(secret, body), header)


def verify_github(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """GitHub's `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the raw body>`."""
    return _prefixed_sha256(secret, body, header)


def verify_generic(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """The `hmac-body` scheme: `X-Signature: sha256=<hex HMAC-SHA256 of the raw body>`."""
    return _prefixed_sha256(secret, body, header)


def verify_github_any(keys: Sequence[bytes], body: bytes, header: str | None) -> bool:
    """`verify_github` under any of `keys`; one HMAC per key whatever the header."""
    matched = False
    for key in keys:
        matched |= _prefixed_matches(_digest(key, body), header)
    return matched


verify_generic_any = verify_github_any  # the same header format, named X-Signature


def _timestamp_within(text: str | None, now: float, tolerance: float) -> bool:
    return (text is not None and _DIGITS.fullmatch(text) is not None
            and abs(now - int(text)) <= tolerance)


def verify_slack(keys: Sequence[bytes], body: bytes, timestamp: str | None,
                 signature: str | None, *, now: float,
                 tolerance: float = SLACK_TOLERANCE) -> bool:
    """Slack's scheme: `X-Slack-Signature: v0=<hex HMAC-SHA256 of
    "v0:<X-Slack-Request-Timestamp>:<raw body>">` under any of `keys`, and the
    timestamp (ASCII digits) within `tolerance` seconds of `now`."""
    stamp = timestamp if timestamp is not None and _DIGITS.fullmatch(timestamp) else "0"
    message = b"v0:" + stamp.encode("ascii") + b":" + body
    prefixed = bool(signature) and signature.startswith("v0=")
    matched = False
    for key in keys:
        expected = _digest(key, message)
        matched |= prefixed and _hex_matches(expected, signature[3:])
    return matched and _timestamp_within(timestamp, now, tolerance)


def standard_webhooks_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: `whsec_<base64>` or bare
    base64, decoded as the `standardwebhooks` package decodes it (padding
    optional). Raises ValueError, naming no part of the secret, on anything
    that is not strict base64 (the package would silently drop such characters)."""
    text = secret[len(STANDARD_SECRET_PREFIX):] if secret.startswith(STANDARD_SECRET_PREFIX) \
        else secret
    text = text.rstrip("=")
    if not text or not _BASE64.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("is not whsec_ followed by base64")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not whsec_ followed by base64") from None


def _standard_signatures(header: str) -> list[bytes] | None:
    """The v1 signatures of a `webhook-signature` header, space-separated
    "<version>,<base64>" entries; None if any entry is malformed (the package
    raises on those) or there are too many. Other versions are skipped."""
    entries = header.split(" ")
    if len(entries) > MAX_STANDARD_SIGNATURES:
        return None
    found = []
    for entry in entries:
        parts = entry.split(",")
        if len(parts) != 2:
            return None
        version, value = parts
        if version != "v1":
            continue
        if not value or not _BASE64.fullmatch(value.rstrip("=")) or len(value) % 4:
            return None
        try:
            found.append(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError):
            return None
    return found


def verify_standard_webhooks(keys: Sequence[bytes], body: bytes, msg_id: bytes | None,
                             timestamp: str | None, signature: str | None, *, now: float,
                             tolerance: float = STANDARD_TOLERANCE) -> bool:
    """Standard Webhooks: some v1 entry of `webhook-signature` is the base64
    HMAC-SHA256 of "<webhook-id>.<webhook-timestamp>.<raw body>" under one of
    `keys` (decoded secrets), and the timestamp is within `tolerance` seconds
    of `now`. `msg_id` is the header's raw bytes, as signed.

    Equal to `standardwebhooks.Webhook.verify` on every delivery that package
    signs; stricter on headers it never produces (a timestamp that is not
    plain ASCII digits, base64 with stray characters, an empty entry: refused
    here, where the package may parse them loosely)."""
    # One HMAC per key whatever the headers, as verify_generic_any does: a
    # generic source's scheme is configuration, and the time taken must not
    # tell which scheme (or whether any) is configured.
    given = _standard_signatures(signature) if signature else None
    stamp = timestamp if timestamp is not None and _DIGITS.fullmatch(timestamp) else "0"
    message = (msg_id or b"") + b"." + stamp.encode("ascii") + b"." + body
    matched = False
    for key in keys:
        expected = _digest(key, message)
        for candidate in given or ():
            matched |= hmac.compare_digest(expected, candidate)
    return bool(msg_id) and matched and _timestamp_within(timestamp, now, tolerance)


@dataclass(frozen=True)
class StripeSignature:
    timestamp: int
    timestamp_text: str  # as sent: the signed payload uses these exact characters
    v1: tuple[str, ...]


def parse_stripe_header(header: str | None) -> StripeSignature:
    """Parse `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...][,v0=...]`.

    Raises ValueError when there is no single integer `t` or no `v1` entry;
    other schemes (v0, test-mode extras) are ignored, as Stripe advises."""
    if not header:
        raise ValueError("missing Stripe-Signature")
    timestamps: list[str] = []
    v1: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "t":
            timestamps.append(value)
        elif key == "v1":
            v1.append(value)
    if len(timestamps) != 1 or not _DIGITS.fullmatch(timestamps[0]):
        raise ValueError("Stripe-Signature needs exactly one integer t=")
    if not v1:
        raise ValueError("Stripe-Signature has no v1= signature")
    if len(v1) > MAX_STRIPE_SIGNATURES:
        raise ValueError(f"Stripe-Signature has more than {MAX_STRIPE_SIGNATURES} v1= signatures")
    return StripeSignature(int(timestamps[0]), timestamps[0], tuple(v1))


def verify_stripe(secret: str | bytes, body: bytes, header: str | None, *, now: float,
                  tolerance: float = 300) -> bool:
    """Stripe's scheme: some v1 entry is the hex HMAC-SHA256 of "<t>.<raw body>"
    (several are sent while a secret is being rolled: any may match), and
    |now - t| <= tolerance seconds, against replays of an old delivery."""
    try:
        parsed = parse_stripe_header(header)
    except ValueError:
        return False
    expected = _digest(secret, parsed.timestamp_text.encode("ascii") + b"." + body)
    # Every entry is compared (no early exit), so the time taken does not say
    # which entry matched.
    matched = False
    for candidate in parsed.v1:
        matched |= _hex_matches(expected, candidate)
    return matched and abs(now - parsed.timestamp) <= tolerance


def verify_stripe_any(keys: Sequence[bytes], body: bytes, header: str | None, *, now: float,
                      tolerance: float = 300) -> bool:
    """`verify_stripe` under any of `keys` (every key tried)."""
    matched = False
    for key in keys:
        matched |= verify_stripe(key, body, header, now=now, tolerance=tolerance)
    return matched
