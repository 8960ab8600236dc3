"""Throwaway PostgreSQL clusters from the local binaries, and scratch databases.

`TemporaryCluster` runs initdb in a temporary directory and starts a server on a
free loopback port; `stop()` removes everything it made. PostgreSQL refuses to
run as root, so under root the cluster is run by the `postgres` account (or
`nobody`). `scratch_database(url)` creates a fresh database on any server and
drops it afterwards. The demo and the test suite use both.
"""

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import conninfo, sql

from agent_inbox import errors


def find_bindir() -> Path:
    """The directory holding initdb, pg_ctl and postgres."""
    found = shutil.which("pg_ctl")
    candidates = [Path(os.path.realpath(found)).parent] if found else []
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                      key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
                      reverse=True)
    candidates += [Path(p) for p in versions]
    for bindir in candidates:
        if (bindir / "initdb").exists() and (bindir / "postgres").exists():
            return bindir
    raise errors.DatabaseUnavailable(
        "no local PostgreSQL binaries (initdb, pg_ctl, postgres) found: install PostgreSQL "
        "server packages or pass a database URL")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_account() -> str | None:
    """The unprivileged account to run the server as, or None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise errors.DatabaseUnavailable("running as root and no unprivileged account to run PostgreSQL")


class TemporaryCluster:
    """A PostgreSQL cluster in a temporary directory, listening on 127.0.0.1.

    `durable=False` (the default) turns fsync off: fast, and fine for data that
    dies with the cluster. Usable as a context manager.
    """

    def __init__(self, *, durable: bool = False, settings: dict[str, str] | None = None,
                 trusted_networks: tuple[str, ...] = ()):
        self.bindir = find_bindir()
        self.account = _server_account()
        self.port = _free_port()
        self.settings = {"listen_addresses": "127.0.0.1", "max_connections": "200"}
        if not durable:
            self.settings.update(fsync="off", synchronous_commit="off", full_page_writes="off")
        self.settings.update(settings or {})
        self.trusted_networks = trusted_networks  # CIDRs allowed in without a password
        self.root = Path(tempfile.mkdtemp(prefix="agent-inbox-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._started = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def running(self) -> bool:
        return self._started

    def _run(self, *args: str) -> None:
        kwargs = {"user": self.account} if self.account else {}
        done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise errors.DatabaseUnavailable(
                f"{Path(args[0]).name} failed ({done.returncode}): {done.stderr.strip()} {log[-2000:]}")

    def start(self) -> "TemporaryCluster":
        if self.account:
            shutil.chown(self.root, user=self.account)
        if not self.data.exists():
            self._run(self.bindir / "initdb", "-D", self.data, "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--locale=C", "--no-sync")
            with open(self.data / "pg_hba.conf", "a") as hba:
                for network in self.trusted_networks:
                    hba.write(f"host all all {network} trust\n")
        options = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._run(self.bindir / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.root} {options}", "start")
        self._started = True
        atexit.register(self.stop)
        return self

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server (fast shutdown) and, by default, delete its files."""
        if self._started:
            self._started = False
            with contextlib.suppress(errors.DatabaseUnavailable):
                self._run(self.bindir / "pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
            atexit.unregister(self.stop)

    def restart(self) -> None:
        """Stop and start on the same port, keeping the data: a server restart."""
        self.stop(remove=False)
        self.start()

    def __enter__(self) -> "TemporaryCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def with_database(url: str, dbname: str) -> str:
    """The same server and credentials as `url`, another database."""
    return conninfo.make_conninfo(url, dbname=dbname)


def create_database(server_url: str, *, prefix: str = "agent_inbox", template: str | None = None) -> str:
    """Create a fresh database on the server of `server_url`; its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(statement)
    return with_database(server_url, name)


def drop_database(url: str) -> None:
    """Drop the database `url` names, disconnecting anyone still in it."""
    name = conninfo.conninfo_to_dict(url)["dbname"]
    server_url = with_database(url, "postgres")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextlib.contextmanager
def scratch_database(server_url: str | None, *, prefix: str = "agent_inbox") -> Iterator[str]:
    """A fresh database for the duration of the block, on `server_url`'s server,
    or, given None, on a throwaway cluster started for the block."""
    with contextlib.ExitStack() as stack:
        if server_url is None:
            server_url = stack.enter_context(TemporaryCluster()).url
        url = create_database(server_url, prefix=prefix)
        stack.callback(drop_database, url)
        yield url


# Citus needs its library preloaded; its nodes reach each other over loopback
# without TLS (a throwaway cluster has no certificates, and the server runs
# under an account whose HOME may be unreadable).
CITUS_SETTINGS = {"shared_preload_libraries": "citus", "citus.node_conninfo": "sslmode=disable"}


def citus_installed() -> bool:
    """Whether the local PostgreSQL has the Citus extension's files (the check
    tests/setup-deps.sh makes too): /usr/lib/postgresql/15/lib/citus.so and
    /usr/share/postgresql/15/extension/citus.control for /usr/lib/postgresql/15/bin."""
    try:
        bindir = find_bindir()
    except errors.DatabaseUnavailable:
        return False
    share = bindir.parents[3] / "share" / "postgresql" / bindir.parent.name / "extension"
    return (bindir.parent / "lib" / "citus.so").exists() and (share / "citus.control").exists()


class CitusCluster:
    """A Citus coordinator and `workers` worker nodes, each a TemporaryCluster on
    its own loopback port, with the extension created in their `postgres`
    database and the workers added to the coordinator. `url` is the
    coordinator's; `stop()` stops and removes every node. A database made on the
    coordinator for a test needs the extension and the nodes too:
    `create_database()` does both."""

    def __init__(self, *, workers: int = 2, settings: dict[str, str] | None = None):
        options = {**CITUS_SETTINGS, **(settings or {})}
        self.coordinator = TemporaryCluster(settings=options)
        self.workers = [TemporaryCluster(settings=options) for _ in range(workers)]

    @property
    def nodes(self) -> list[TemporaryCluster]:
        return [self.coordinator, *self.workers]

    @property
    def url(self) -> str:
        return self.coordinator.url

    def start(self) -> "CitusCluster":
        try:
            for node in self.nodes:
                node.start()
            self._attach("postgres")
        except BaseException:
            self.stop()
            raise
        return self

    def _attach(self, dbname: str) -> None:
        for node in self.workers:
            with psycopg.connect(with_database(node.url, dbname), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
        with psycopg.connect(with_database(self.url, dbname), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
            conn.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)",
                         (self.coordinator.port,))
            for node in self.workers:
                conn.execute("SELECT citus_add_node('127.0.0.1', %s)", (node.port,))

    def create_database(self, *, prefix: str = "agent_inbox_citus") -> str:
        """A fresh database of the same name on every node, Citus set up in it;
        the coordinator's URL. drop_database() removes it from every node."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        for node in self.nodes:
            with psycopg.connect(node.url, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self._attach(name)
        return with_database(self.url, name)

    def drop_database(self, url: str) -> None:
        name = conninfo.conninfo_to_dict(url)["dbname"]
        for node in self.nodes:
            drop_database(with_database(node.url, name))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "CitusCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
