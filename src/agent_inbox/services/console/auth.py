"""Who may use the console, and how a request proves it.

Invariant: no page and no action without authentication. A request is
authenticated by `Authorization: Bearer <token>` (scripts) or by a session
cookie the login form set (browsers); anything else gets the login page (a
browser) or 401 (a script). Every POST from a session must carry the session's
CSRF token; a bearer request need not, as a browser never attaches a bearer
token on its own, so a forged cross-site request cannot carry one.

Tokens: `name:role:token` lines (AGENT_INBOX_CONSOLE_TOKENS, comma-separated, or
one a line in --tokens-file). Roles, each a set of rights:

    viewer    view every page (payloads hidden with --hide-payloads-from-viewers)
    operator  view, requeue/discard dead events, retry/discard failed batches,
              pause, resume and cancel a user's agent, pause and resume the fleet
    approver  view, answer approval requests, set or clear permission rules
              (what ctx.permit answers: a user's and the defaults), and pause,
              resume and cancel a user's agent (not the fleet's)

A person with both duties holds `operator+approver`. Tokens are compared in
constant time (hmac.compare_digest over every configured token).

A session cookie is `<body>.<mac>`: body is base64url JSON {name, token
fingerprint, expiry, nonce}, mac an HMAC-SHA256 of it under the console's key
(AGENT_INBOX_CONSOLE_SECRET, else random at each start, so a restart ends every
session). It is HttpOnly, SameSite=Strict, and Secure unless the console listens
on loopback and the request came over plain HTTP; a token's rotation ends its
sessions (the fingerprint). The CSRF token is an HMAC of the session's nonce.

A session also lives on the server (Sessions: the console_sessions table, shared
by every console process and kept across restarts): a cookie opens nothing once
its row is gone, and a logout deletes it; a console's start deletes the rows of
tokens it no longer has (under its key), so a token removed and later put back
does not bring its old sessions back.

Failures are throttled (Throttle): past PER_CLIENT failed logins or bearer
tokens from one client address in WINDOW seconds, or OVERALL from all of them,
every login and bearer request from there (or from anyone) is answered 429
until the window has room, without the token being checked. The counts are in
the memory of each console process: N processes allow N times as many.
"""

import base64
import collections
import hashlib
import hmac
import json
import math
import secrets
import string
import threading
import time
from collections import deque
from dataclasses import dataclass

from agent_inbox import errors

RIGHTS = {"viewer": {"view"}, "operator": {"view", "repair", "stop", "fleet"},
          "approver": {"view", "approve", "policy", "stop"}}
MIN_TOKEN = 16
MIN_TOKEN_BITS = 128
WEAK_TOKEN = (f"has a weak token: a token needs at least {MIN_TOKEN_BITS} bits of entropy, "
              "estimated as its length times the bits of the character classes it uses, "
              "and refused if it repeats itself or has few distinct characters; use 32 or "
              "more random hex characters, or `agent-inbox console token new`")
MIN_SECRET = 32
COOKIE = "agent_inbox_console"
TOKENS_ENV = "AGENT_INBOX_CONSOLE_TOKENS"
SECRET_ENV = "AGENT_INBOX_CONSOLE_SECRET"


@dataclass(frozen=True)
class Principal:
    """Someone authenticated: a token's name, its rights, and how they came."""

    name: str
    rights: frozenset
    nonce: str | None = None  # the session's; None for a bearer request

    def can(self, right: str) -> bool:
        return right in self.rights

    @property
    def actor(self) -> str:
        """Who is recorded in operator_actions for this principal's repairs."""
        return f"console:{self.name}"


@dataclass(frozen=True)
class Token:
    name: str
    roles: tuple[str, ...]
    secret: str

    @property
    def rights(self) -> frozenset:
        return frozenset().union(*(RIGHTS[role] for role in self.roles))


def parse_tokens(text: str, origin: str) -> list[Token]:
    """The `name:role:token` entries of `text` (commas or newlines between them;
    blank lines and lines starting with '#' skipped). InvalidInput names the
    entry and what is wrong with it; the token itself is never echoed."""
    tokens: list[Token] = []
    entries = [e.strip() for line in text.splitlines() for e in line.split(",")]
    for number, entry in enumerate((e for e in entries if e and not e.startswith("#")), 1):
        parts = entry.split(":", 2)
        where = f"{origin}, entry {number}"
        if len(parts) != 3 or not parts[0].strip():
            raise errors.InvalidInput(where, "(not shown)", "must be name:role:token")
        name, role_text, secret = parts[0].strip(), parts[1].strip(), parts[2].strip()
        roles = tuple(role_text.split("+"))
        unknown = [r for r in roles if r not in RIGHTS]
        if unknown:
            raise errors.InvalidInput(where, name, f"has unknown role {unknown[0]!r} (roles: "
                                                   f"{', '.join(RIGHTS)}, joined with '+')")
        if len(secret) < MIN_TOKEN:
            raise errors.InvalidInput(where, name, f"has a token shorter than {MIN_TOKEN} "
                                                   "characters")
        if not strong(secret):
            raise errors.InvalidInput(where, name, WEAK_TOKEN)
        if any(t.name == name for t in tokens):
            raise errors.InvalidInput(where, name, "repeats a name given before")
        if any(hmac.compare_digest(t.secret, secret) for t in tokens):
            raise errors.InvalidInput(where, name, "repeats another entry's token")
        tokens.append(Token(name, roles, secret))
    return tokens


def token_bits(token: str) -> float:
    """A rough estimate of a token's entropy in bits: the lower of its length
    times the bits of the character classes it uses (hex counted as hex), and
    1.5 times its characters' Shannon entropy (which repeats pull down). It
    catches repeats and small alphabets, not every weak choice."""
    if not token:
        return 0.0
    chars = set(token)
    if chars <= set(string.hexdigits.lower()) or chars <= set(string.hexdigits.upper()):
        alphabet = 16
    else:
        alphabet = sum(len(c) for c in (string.ascii_lowercase, string.ascii_uppercase,
                                        string.digits) if chars & set(c))
        alphabet += 33 if any(not c.isascii() or not c.isalnum() for c in chars) else 0
    by_classes = len(token) * math.log2(max(alphabet, 2))
    counts = collections.Counter(token).values()
    shannon = -sum(n / len(token) * math.log2(n / len(token)) for n in counts) * len(token)
    # A short sample's Shannon entropy is far below its source's (22 random
    # base64url characters measure about 98 bits): it counts half again, enough
    # to pass random tokens and still refuse repeats and words.
    return min(by_classes, shannon * 1.5)


def strong(token: str) -> bool:
    """Whether `token` plausibly holds MIN_TOKEN_BITS bits: long enough for it,
    not a repetition of a shorter string, and not made of few characters."""
    period = next((p for p in range(1, len(token) // 2 + 1)
                   if len(token) % p == 0 and token == token[:p] * (len(token) // p)), None)
    return period is None and token_bits(token) >= MIN_TOKEN_BITS


def new_token() -> str:
    """A token of 256 random bits, base64url (43 characters)."""
    return secrets.token_urlsafe(32)


def load_tokens(env_value: str | None, tokens_file: str | None) -> list[Token]:
    """The tokens of the file and the environment; InvalidInput if there are none."""
    tokens: list[Token] = []
    if tokens_file:
        try:
            with open(tokens_file, encoding="utf-8") as handle:
                tokens += parse_tokens(handle.read(), f"--tokens-file {tokens_file}")
        except OSError as exc:
            raise errors.InvalidInput("--tokens-file", tokens_file,
                                      f"cannot be read: {exc.strerror}") from None
    if env_value:
        tokens += parse_tokens(env_value, TOKENS_ENV)
    names = [t.name for t in tokens]
    if len(set(names)) != len(names):
        raise errors.InvalidInput("tokens", sorted(n for n in names if names.count(n) > 1)[0],
                                  "is a name given both in the file and the environment")
    if not tokens:
        raise errors.InvalidInput("tokens", None, f"none configured: set {TOKENS_ENV} "
                                                  "or --tokens-file (name:role:token lines)")
    return tokens


class Throttle:
    """Failed logins and bearer tokens, per client address and over all, in a
    sliding window (see the module). Bounded: at most MAX_CLIENTS addresses kept."""

    PER_CLIENT = 10
    OVERALL = 100
    WINDOW = 60.0
    MAX_CLIENTS = 10_000

    def __init__(self, *, per_client: int = PER_CLIENT, overall: int = OVERALL,
                 window: float = WINDOW, clock=time.monotonic):
        self.per_client, self.overall, self.window, self.clock = per_client, overall, window, clock
        self.clients: dict[str, deque] = {}
        self.all: deque = deque()
        self._lock = threading.Lock()  # bearer checks run in the threadpool

    def _trim(self, times: deque, now: float) -> deque:
        while times and times[0] <= now - self.window:
            times.popleft()
        return times

    def wait(self, client: str) -> float:
        """Seconds until `client` may try again; 0 if it may now."""
        with self._lock:
            return self._wait(client)

    def _wait(self, client: str) -> float:
        now = self.clock()
        waits = []
        mine = self.clients.get(client)
        if mine is not None and len(self._trim(mine, now)) >= self.per_client:
            waits.append(mine[-self.per_client] + self.window - now)
        if len(self._trim(self.all, now)) >= self.overall:
            waits.append(self.all[-self.overall] + self.window - now)
        return max(waits, default=0.0)

    def failed(self, client: str) -> int:
        """Count a failure of `client`; its failures in the window."""
        with self._lock:
            return self._failed(client)

    def _failed(self, client: str) -> int:
        now = self.clock()
        if client not in self.clients and len(self.clients) >= self.MAX_CLIENTS:
            for other in [c for c, t in self.clients.items() if not self._trim(t, now)]:
                del self.clients[other]
            if len(self.clients) >= self.MAX_CLIENTS:  # still full: forget the oldest
                del self.clients[next(iter(self.clients))]
        mine = self._trim(self.clients.setdefault(client, deque()), now)
        mine.append(now)
        self.all.append(now)
        if len(self.all) > self.overall:
            self.all.popleft()
        if len(mine) > self.per_client:
            mine.popleft()
        return len(mine)


class MemorySessions:
    """Live sessions in this process only (tests; the command uses Sessions)."""

    def __init__(self):
        self.rows: dict[str, tuple[str, str, str, int]] = {}

    def add(self, sid: str, name: str, key_id: str, fingerprint: str, expires_at: int) -> None:
        self.rows[sid] = (name, key_id, fingerprint, expires_at)

    def alive(self, sid: str, now: int) -> bool:
        row = self.rows.get(sid)
        return row is not None and row[3] >= now

    def end(self, sid: str) -> None:
        self.rows.pop(sid, None)


class Sessions(MemorySessions):
    """Live sessions in the console_sessions table (every console process, and
    across restarts)."""

    def __init__(self, pool):
        self.pool = pool

    def add(self, sid, name, key_id, fingerprint, expires_at) -> None:
        from agent_inbox import db
        with db.connection(self.pool) as conn:
            conn.execute("DELETE FROM console_sessions WHERE expires_at < %s",
                         (int(time.time()),))
            conn.execute("INSERT INTO console_sessions (id, token_name, key_id, fingerprint, "
                         "expires_at) VALUES (%s, %s, %s, %s, %s)",
                         (sid, name, key_id, fingerprint, expires_at))

    def alive(self, sid, now) -> bool:
        from agent_inbox import db
        with db.connection(self.pool) as conn:
            return conn.execute("SELECT 1 FROM console_sessions WHERE id = %s AND "
                                "expires_at >= %s", (sid, now)).fetchone() is not None

    def end(self, sid) -> None:
        from agent_inbox import db
        with db.connection(self.pool) as conn:
            conn.execute("DELETE FROM console_sessions WHERE id = %s", (sid,))

    def end_unconfigured(self, key_id: str, fingerprints: list[str]) -> int:
        """Delete the sessions under this key of tokens not configured (as
        they are now), and expired ones; how many sessions of tokens ended."""
        from agent_inbox import db
        with db.connection(self.pool) as conn:
            conn.execute("DELETE FROM console_sessions WHERE expires_at < %s",
                         (int(time.time()),))
            return conn.execute("DELETE FROM console_sessions WHERE key_id = %s AND "
                                "NOT (fingerprint = ANY(%s))", (key_id, fingerprints)).rowcount


class Authenticator:
    """Checks bearer tokens and session cookies, makes sessions and CSRF tokens."""

    def __init__(self, tokens: list[Token], *, session_ttl: int, key: bytes | None = None,
                 sessions: MemorySessions | None = None):
        self.tokens = tokens
        self.session_ttl = session_ttl
        self.key = key or secrets.token_bytes(32)
        self.sessions = sessions if sessions is not None else MemorySessions()
        self.key_id = self._mac(b"key-id")[:16]
        self.throttle = Throttle()

    def by_token(self, presented: str) -> Token | None:
        """The token matching `presented`, comparing with every one in constant time."""
        found = None
        for token in self.tokens:
            if hmac.compare_digest(token.secret.encode(), presented.encode()):
                found = token
        return found

    def _fingerprint(self, token: Token) -> str:
        return self._mac(b"token:" + token.secret.encode())[:22]

    def _mac(self, data: bytes) -> str:
        digest = hmac.new(self.key, data, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def fingerprints(self) -> list[str]:
        return [self._fingerprint(t) for t in self.tokens]

    @staticmethod
    def _sid(nonce: str) -> str:
        return hashlib.sha256(nonce.encode()).hexdigest()

    def new_session(self, token: Token, now: float | None = None) -> str:
        """A cookie value for a session of `token`, valid for session_ttl seconds
        (and recorded in `sessions`, until then or a logout)."""
        expiry = int((now or time.time()) + self.session_ttl)
        nonce = secrets.token_urlsafe(16)
        fingerprint = self._fingerprint(token)
        body = json.dumps({"n": token.name, "f": fingerprint, "e": expiry,
                           "c": nonce}, separators=(",", ":")).encode()
        encoded = base64.urlsafe_b64encode(body).rstrip(b"=").decode()
        self.sessions.add(self._sid(nonce), token.name, self.key_id, fingerprint, expiry)
        return f"{encoded}.{self._mac(encoded.encode())}"

    def end_session(self, principal: Principal) -> None:
        """Log out: the session's cookie opens nothing from now on."""
        if principal.nonce is not None:
            self.sessions.end(self._sid(principal.nonce))

    def from_session(self, cookie: str | None, now: float | None = None) -> Principal | None:
        """The session's principal, or None if the cookie is missing, forged,
        expired, or of a token no longer configured as it was."""
        if not cookie or cookie.count(".") != 1 or not cookie.isascii():
            return None
        encoded, mac = cookie.split(".")
        if not hmac.compare_digest(mac, self._mac(encoded.encode())):
            return None
        try:
            body = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
        except ValueError:
            return None
        if body["e"] < (now or time.time()):
            return None
        token = next((t for t in self.tokens if t.name == body["n"]), None)
        if token is None or not hmac.compare_digest(self._fingerprint(token), body["f"]):
            return None
        if not self.sessions.alive(self._sid(body["c"]), int(now or time.time())):
            return None  # logged out, or its token was removed
        return Principal(token.name, token.rights, body["c"])

    def from_bearer(self, header: str | None) -> Principal | None:
        if not header or not header.startswith("Bearer "):
            return None
        token = self.by_token(header[len("Bearer "):].strip())
        return None if token is None else Principal(token.name, token.rights)

    def csrf_token(self, principal: Principal) -> str:
        return self._mac(b"csrf:" + principal.nonce.encode()) if principal.nonce else ""

    def csrf_ok(self, principal: Principal, presented: str | None) -> bool:
        """A bearer request needs none; a session's POST must carry its own."""
        if principal.nonce is None:
            return True
        return bool(presented) and hmac.compare_digest(self.csrf_token(principal), presented)


def key_from_env(value: str | None) -> bytes | None:
    """The session key from AGENT_INBOX_CONSOLE_SECRET (kept across restarts), or
    None for a random one; InvalidInput if it is too short to be a key."""
    if value is None or value == "":
        return None
    if len(value) < MIN_SECRET:
        raise errors.InvalidInput(SECRET_ENV, "(not shown)",
                                  f"must be at least {MIN_SECRET} characters")
    return value.encode()
