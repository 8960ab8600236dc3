"""Webhook secrets per user and source, from a JSON or TOML file, reloaded on SIGHUP.

Invariants: a secret value is never logged, echoed in an error or put in a repr
(only user and source names, counts and the file's path are); a file that fails
to load or to validate is refused whole, so a reload that fails keeps the
previous secrets; the secrets in use are swapped in one assignment, so a request
sees either the old set or the new one, never a mix.

The file maps user -> source -> entry; an entry is a secret, a list of up to two
(a secret being rotated: either verifies), or an object naming its scheme:

    {"alice": {"github": "s3cret...", "stripe": "whsec_...",
               "linear": "whsec_<base64>",
               "crm": {"scheme": "hmac-body", "secret": "..."}}}     (secrets.json)

    [alice]                                                        (secrets.toml)
    github = ["new-s3cret...", "old-s3cret..."]
    crm = { scheme = "hmac-body", secret = "..." }

The scheme of `github`, `stripe` and `slack` is theirs; any other source is
`standard-webhooks` (the default) or `hmac-body`. A secret shorter than 16
bytes (for Standard Webhooks, its decoded key) or one still holding a
placeholder (`replace-with-...`) is refused.

A file cut off while being written must not load as a smaller set of users.
JSON cannot be cut and still parse (its closing brace is last). TOML can, at any
line end, so a TOML file is refused unless it ends with a newline, a user table
with no source is refused (a cut after a header), an entry object without its
secret is refused, and a file whose size or mtime changes while it is read is
refused; a reload that would remove a user or source reads the file again
until two reads 0.2 s apart agree (a writer still at work has finished), and
logs how many it removed. A file cut exactly between two complete lines, and
left so, is still undetectable from its content: replace the file by rename
(README), never rewrite it in place.
"""

import json
import logging
import os
import re
import signal
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from agent_inbox import errors
from agent_inbox.services.ingest import signatures

log = logging.getLogger("agent_inbox.ingest")

# Sources with a route of their own, signed by their provider's scheme only.
PROVIDER_SCHEMES = {"github": "github", "stripe": "stripe", "slack": "slack"}
# Any other source: Standard Webhooks by default, or the old body-only scheme.
GENERIC_SCHEMES = ("standard-webhooks", "hmac-body")
DEFAULT_GENERIC_SCHEME = "standard-webhooks"
SCHEMES = (*PROVIDER_SCHEMES.values(), *GENERIC_SCHEMES)
MIN_SECRET_BYTES = 16
# A reload that would remove users or sources reads the file again this long
# after, up to this many times, until two reads agree.
RELOAD_SETTLE = 0.2
RELOAD_SETTLE_READS = 5
# A rotation needs the new secret and the old one; verification always does
# this many HMACs (padding with unknown keys), so its time does not say how
# many secrets a source has, or whether it has any.
MAX_SECRETS = 2
# Placeholders left in an example file: "replace-with-...", "changeme", "<secret>".
_PLACEHOLDER = re.compile(r"replace[-_ ]?(with|me)|change[-_ ]?me|^<.*>$|^x+$", re.IGNORECASE)


@dataclass(frozen=True, eq=True)
class Credential:
    """How one user's source is verified: its scheme and HMAC keys (bytes,
    already decoded for Standard Webhooks). The repr never shows a key."""

    scheme: str
    keys: tuple[bytes, ...]

    def __repr__(self) -> str:
        return f"<Credential {self.scheme}, {len(self.keys)} secret(s)>"


Secrets = Mapping[str, Mapping[str, Credential]]


def _valid_name(name: object) -> bool:
    return isinstance(name, str) and name != "" and "\x00" not in name and "/" not in name


def _entry(user: str, source: str, entry: object, refuse) -> Credential:
    """One entry checked and turned into a Credential; `refuse(problem)` makes
    the error (naming user and source, never a secret)."""
    at = f"user {user!r} source {source!r}"
    if isinstance(entry, Credential):  # already checked (a SecretStore's own)
        return entry
    scheme = PROVIDER_SCHEMES.get(source, DEFAULT_GENERIC_SCHEME)
    if isinstance(entry, Mapping):
        unknown = sorted(str(k) for k in entry if k not in ("scheme", "secret", "secrets"))
        if unknown:
            raise refuse(f"{at}: unknown field {unknown[0]!r} (the fields are scheme, secret, "
                         "secrets)")
        if "scheme" in entry:
            named = entry["scheme"]
            if not isinstance(named, str) or named not in SCHEMES:
                raise refuse(f"{at}: unknown scheme (the schemes are {', '.join(SCHEMES)})")
            allowed = (PROVIDER_SCHEMES[source],) if source in PROVIDER_SCHEMES else GENERIC_SCHEMES
            if named not in allowed:
                raise refuse(f"{at}: scheme {named!r} is not for this source (it takes "
                             f"{' or '.join(allowed)})")
            scheme = named
        if ("secret" in entry) == ("secrets" in entry):
            raise refuse(f"{at}: needs a secret (\"secret\": \"...\", or \"secrets\": [...] "
                         "while rotating), exactly one of the two")
        values = [entry["secret"]] if "secret" in entry else entry["secrets"]
    elif isinstance(entry, list):
        values = entry
    else:
        values = [entry]
    if not isinstance(values, list) or not 1 <= len(values) <= MAX_SECRETS:
        raise refuse(f"{at}: a list of secrets holds 1 to {MAX_SECRETS} (the new and the old "
                     "one while rotating)")
    keys = []
    for n, value in enumerate(values):
        which = at if len(values) == 1 else f"{at} secret {n + 1}"
        if not isinstance(value, str) or not value:
            raise refuse(f"{which}: the secret must be a non-empty string")
        if _PLACEHOLDER.search(value):
            raise refuse(f"{which}: the secret is still a placeholder; set the real one")
        if scheme == "standard-webhooks":
            try:
                key = signatures.standard_webhooks_key(value)
            except ValueError as exc:
                raise refuse(f"{which}: the Standard Webhooks secret {exc} (for the old "
                             "body-only X-Signature scheme, write {\"scheme\": \"hmac-body\", "
                             "\"secret\": ...})") from None
        else:
            key = value.encode("utf-8")
        if len(key) < MIN_SECRET_BYTES:
            what = "decodes to" if scheme == "standard-webhooks" else "is"
            raise refuse(f"{which}: the secret {what} {len(key)} bytes; at least "
                         f"{MIN_SECRET_BYTES} are required")
        keys.append(key)
    return Credential(scheme, tuple(keys))


def validate_secrets(data: object, where: str = "secrets") -> Secrets:
    """Check the shape user -> source -> entry (module docstring); a read-only
    mapping user -> source -> Credential.

    Errors name the user and source but never show a secret."""
    def refuse(problem: str):
        # The value shown is the file (or 'secrets'), never anything read from it.
        return errors.InvalidInput("secrets file", where, problem)

    if not isinstance(data, Mapping):
        raise refuse("must map each user to a table of source -> secret")
    if not data:
        raise refuse("holds no user (an empty file, or one cut off while being written?)")
    checked: dict[str, Mapping[str, Credential]] = {}
    for user, sources in data.items():
        if not _valid_name(user):
            raise refuse("has a user name that is empty, holds '/' or NUL, or is not a string")
        if not isinstance(sources, Mapping):
            raise refuse(f"user {user!r} must map each source to its secret")
        if not sources:
            raise refuse(f"user {user!r} has no source (a file cut off after a table header?)")
        inner: dict[str, Credential] = {}
        for source, entry in sources.items():
            if not _valid_name(source):
                raise refuse(f"user {user!r} has a source name that is empty, holds '/' or NUL, "
                             "or is not a string")
            inner[source] = _entry(user, source, entry, refuse)
        checked[user] = MappingProxyType(inner)
    return MappingProxyType(checked)


def load_secrets(path: str | os.PathLike) -> Secrets:
    """Read and check a secrets file (.json or .toml, by extension).

    Raises errors.InvalidInput, whose message holds no secret: parser messages
    carry only a position, and the shape check names users and sources only."""
    path = Path(path)
    where = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise errors.InvalidInput("secrets file", where, "must end in .json or .toml")
    try:
        with open(path, "rb") as file:
            before = os.fstat(file.fileno())
            raw = file.read()
            after = os.fstat(file.fileno())
    except OSError as exc:
        raise errors.InvalidInput("secrets file", where,
                                  f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) \
            or len(raw) != after.st_size:
        raise errors.InvalidInput("secrets file", where,
                                  "changed while it was being read (replace it by rename, "
                                  "never rewrite it in place)")
    if suffix == ".toml" and raw and not raw.endswith(b"\n"):
        raise errors.InvalidInput("secrets file", where,
                                  "does not end with a newline: it may have been cut off while "
                                  "being written (replace it by rename)")
    try:
        text = raw.decode("utf-8")
        data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    except UnicodeDecodeError:
        raise errors.InvalidInput("secrets file", where, "is not UTF-8") from None
    except json.JSONDecodeError as exc:
        # Only the position: exc.doc (the whole file) must not travel further.
        raise errors.InvalidInput("secrets file", where,
                                  f"is not valid JSON: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}") from None
    except tomllib.TOMLDecodeError as exc:
        # Only the position: some tomllib messages quote a character of the input.
        at = re.search(r"\((at [^()]*)\)$", str(exc))
        raise errors.InvalidInput("secrets file", where,
                                  f"is not valid TOML ({at.group(1) if at else 'position unknown'})"
                                  ) from None
    except (ValueError, RecursionError) as exc:
        raise errors.InvalidInput("secrets file", where,
                                  f"cannot be parsed ({type(exc).__name__})") from None
    return validate_secrets(data, where)


def _count(secrets: Secrets) -> str:
    return f"{len(secrets)} users, {sum(len(s) for s in secrets.values())} secrets"


def _removed(old: Secrets, new: Secrets) -> str:
    """What a reload drops, as counts (an operator sees a file that lost users)."""
    users = sum(1 for user in old if user not in new)
    sources = sum(1 for user, have in old.items() for source in have
                  if source not in new.get(user, {}))
    return f"; removed {users} users, {sources} secrets" if sources else ""


class SecretStore:
    """The secrets in use; `reload()` re-reads the file, and `install_sighup()`
    makes SIGHUP do so (off the signal handler, in a small thread)."""

    def __init__(self, secrets: Secrets, path: str | os.PathLike | None = None):
        self._secrets = validate_secrets(secrets, str(path) if path else "secrets")
        self.path = Path(path) if path is not None else None
        self._reload_requested = threading.Event()
        self._reloads = 0
        self._reloader: threading.Thread | None = None
        self._closed = False

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SecretStore":
        return cls(load_secrets(path), path)

    def __repr__(self) -> str:  # never the values
        return f"<SecretStore {self.describe()}>"

    def describe(self) -> str:
        """Where the secrets come from and how many there are; never a value."""
        return f"{self.path or '(in memory)'}: {_count(self._secrets)}"

    def get(self, user: str, source: str) -> Credential | None:
        """How this user's source is verified, or None if it has no secret."""
        sources = self._secrets.get(user)
        return None if sources is None else sources.get(source)

    @property
    def reloads(self) -> int:
        """How many reloads have succeeded (for tests and operators)."""
        return self._reloads

    def reload(self) -> bool:
        """Re-read the file; on any failure keep the secrets in use and log why
        (never the values). True if the new secrets are now in use."""
        if self.path is None:
            log.warning("secrets reload requested, but they did not come from a file")
            return False
        try:
            fresh = self._load_settled()
        except errors.InvalidInput as exc:
            log.error("secrets reload failed, keeping the previous secrets: %s", exc)
            return False
        except Exception as exc:  # never let the reloader thread die
            log.error("secrets reload failed, keeping the previous secrets: %s",
                      type(exc).__name__)
            return False
        removed = _removed(self._secrets, fresh)
        self._secrets = fresh  # one assignment: requests see old or new, whole
        self._reloads += 1
        log.info("secrets reloaded from %s: %s%s", self.path, _count(fresh), removed)
        return True

    def _load_settled(self) -> Secrets:
        """The file's secrets; if they would remove any user or source, only
        once two reads RELOAD_SETTLE seconds apart agree (a writer still at
        work, rewriting the file in place, has then finished or is refused)."""
        fresh = load_secrets(self.path)
        for _ in range(RELOAD_SETTLE_READS):
            if not _removed(self._secrets, fresh):
                return fresh
            time.sleep(RELOAD_SETTLE)
            again = load_secrets(self.path)
            if again == fresh:
                return fresh
            fresh = again
        raise errors.InvalidInput("secrets file", str(self.path),
                                  "kept changing while it was read (replace it by rename)")

    def request_reload(self) -> None:
        """Safe to call from a signal handler: only sets an event."""
        self._reload_requested.set()

    def install_sighup(self) -> "SecretStore":
        """Reload on SIGHUP (main thread only). The handler only sets an event;
        a daemon thread does the reading and logging, outside signal context."""
        if self._reloader is None:
            self._reloader = threading.Thread(target=self._reload_loop,
                                              name="agent-inbox-secrets-reload", daemon=True)
            self._reloader.start()
        signal.signal(signal.SIGHUP, lambda signum, frame: self.request_reload())
        return self

    def close(self) -> None:
        self._closed = True
        self._reload_requested.set()
        if self._reloader is not None:
            self._reloader.join(timeout=5)

    def _reload_loop(self) -> None:
        while True:
            self._reload_requested.wait()
            self._reload_requested.clear()
            if self._closed:
                return
            log.info("SIGHUP: reloading secrets from %s", self.path)
            self.reload()
