"""Webhook signature checks: pure functions, no I/O, no clock of their own.

Invariant: a check answers True only if the signature is an HMAC-SHA256 of the
exact raw body (for Stripe, of "<t>.<raw body>" with t inside the tolerance)
under the given secret; digests are compared in constant time
(`hmac.compare_digest`), and malformed input answers False, never raises.
"""

import hashlib
import hmac
import re
from dataclasses import dataclass

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII digits only; 18 keeps it inside int64
# Stripe sends one or two v1 entries; a cap keeps a hostile header from
# costing more than a few comparisons.
MAX_STRIPE_SIGNATURES = 8


def _key(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


def _digest(secret: str | bytes, message: bytes) -> bytes:
    return hmac.new(_key(secret), message, hashlib.sha256).digest()


def _hex_matches(expected: bytes, given: str) -> bool:
    """Constant-time comparison of a digest with a hex string (either case)."""
    if not _SHA256_HEX.fullmatch(given):
        return False
    return hmac.compare_digest(expected, bytes.fromhex(given))


def _prefixed_sha256(secret: str | bytes, body: bytes, header: str | None) -> bool:
    if not header:
        return False
    scheme, sep, value = header.strip().partition("=")
    if not sep or scheme.strip().lower() != "sha256":
        return False
    return _hex_matches(_digest(secret, body), value.strip())


def verify_github(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """GitHub's `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the raw body>`."""
    return _prefixed_sha256(secret, body, header)


def verify_generic(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """Any other source's `X-Signature: sha256=<hex HMAC-SHA256 of the raw body>`."""
    return _prefixed_sha256(secret, body, header)


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
