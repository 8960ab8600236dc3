"""Webhook secrets per user and source, from a JSON or TOML file, reloaded on SIGHUP.

Invariants: a secret value is never logged, echoed in an error or put in a repr
(only user and source names, counts and the file's path are); a file that fails
to load or to validate is refused whole, so a reload that fails keeps the
previous secrets; the secrets in use are swapped in one assignment, so a request
sees either the old set or the new one, never a mix.

The file maps user -> source -> secret:

    {"alice": {"github": "s3cret", "stripe": "whsec_..."}}        (secrets.json)

    [alice]                                                        (secrets.toml)
    github = "s3cret"
"""

import json
import logging
import os
import re
import signal
import threading
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from agent_inbox import errors

log = logging.getLogger("agent_inbox.ingest")

Secrets = Mapping[str, Mapping[str, str]]


def _valid_name(name: object) -> bool:
    return isinstance(name, str) and name != "" and "\x00" not in name and "/" not in name


def validate_secrets(data: object, where: str = "secrets") -> Secrets:
    """Check the shape user -> source -> non-empty string; a read-only copy.

    Errors name the user and source but never show a secret."""
    def refuse(problem: str):
        # The value shown is the file (or 'secrets'), never anything read from it.
        return errors.InvalidInput("secrets file", where, problem)

    if not isinstance(data, Mapping):
        raise refuse("must map each user to a table of source -> secret")
    checked: dict[str, Mapping[str, str]] = {}
    for user, sources in data.items():
        if not _valid_name(user):
            raise refuse("has a user name that is empty, holds '/' or NUL, or is not a string")
        if not isinstance(sources, Mapping):
            raise refuse(f"user {user!r} must map each source to its secret")
        inner: dict[str, str] = {}
        for source, secret in sources.items():
            if not _valid_name(source):
                raise refuse(f"user {user!r} has a source name that is empty, holds '/' or NUL, "
                             "or is not a string")
            if not isinstance(secret, str) or not secret:
                raise refuse(f"user {user!r} source {source!r}: the secret must be a non-empty string")
            inner[source] = secret
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
        raw = path.read_bytes()
    except OSError as exc:
        raise errors.InvalidInput("secrets file", where,
                                  f"cannot be read: {exc.strerror or type(exc).__name__}") from None
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

    def get(self, user: str, source: str) -> str | None:
        """The secret for this user and source, or None if there is none."""
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
            fresh = load_secrets(self.path)
        except errors.InvalidInput as exc:
            log.error("secrets reload failed, keeping the previous secrets: %s", exc)
            return False
        except Exception as exc:  # never let the reloader thread die
            log.error("secrets reload failed, keeping the previous secrets: %s",
                      type(exc).__name__)
            return False
        self._secrets = fresh  # one assignment: requests see old or new, whole
        self._reloads += 1
        log.info("secrets reloaded from %s: %s", self.path, _count(fresh))
        return True

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
