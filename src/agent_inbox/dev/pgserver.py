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
import signal
import socket
import subprocess
import tempfile
import time
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


# --- streaming replication: a primary, a standby, a failover -------------------
#
# A primary is a TemporaryCluster made with `replication=True` (and
# `durable=True`: a failover test about lost commits needs fsync on); a
# standby is a StandbyCluster made by `standby_of(primary)`: pg_basebackup -R
# (as the server's account) into its own temporary directory, on its own port,
# streaming from the primary under its own application_name. `kill()` SIGKILLs
# a cluster's postmaster and every process it started, as a machine that loses
# power would; `promote()` makes a standby the primary.

REPLICATION_SETTINGS = {"wal_level": "replica", "max_wal_senders": "10",
                        "max_replication_slots": "10", "hot_standby": "on",
                        "wal_keep_size": "256MB"}

# What a primary waits for before a commit returns, with a synchronous standby.
SYNCHRONOUS_COMMIT = ("on", "remote_write", "remote_apply")


def _postmaster_pid(data: Path) -> int | None:
    try:
        first = (data / "postmaster.pid").read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ReplicatedCluster(TemporaryCluster):
    """A TemporaryCluster that can stream to standbys (REPLICATION_SETTINGS and
    a `host replication all 127.0.0.1/32 trust` line in pg_hba.conf), and be
    killed. `durable` defaults to True here."""

    def __init__(self, *, durable: bool = True, settings: dict[str, str] | None = None,
                 trusted_networks: tuple[str, ...] = ()):
        super().__init__(durable=durable, settings={**REPLICATION_SETTINGS, **(settings or {})},
                         trusted_networks=trusted_networks)
        self.killed = False

    def start(self) -> "ReplicatedCluster":
        fresh = not self.data.exists()
        if fresh:
            # initdb first (as TemporaryCluster.start does), then the replication line
            super().start()
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write("host replication all 127.0.0.1/32 trust\n")
            self.execute("SELECT pg_reload_conf()")
            return self
        super().start()
        return self

    def execute(self, statement: str, params: tuple = ()) -> list[tuple]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description is not None else []

    @property
    def postmaster_pid(self) -> int | None:
        return _postmaster_pid(self.data)

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL the postmaster and every process it started (backends,
        walsenders, the checkpointer...), at once, as a crashed machine dies;
        wait until none is left. The postmaster's pid. The files stay until
        stop()."""
        pid = self.postmaster_pid
        if pid is None:
            raise errors.DatabaseUnavailable(f"no postmaster.pid in {self.data}")
        victims = [pid, *_children_of(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while any(_alive(v) for v in victims):
            if time.monotonic() > deadline:
                raise errors.DatabaseUnavailable(f"processes of the killed server outlived "
                                                 f"{timeout:g} s: {victims}")
            time.sleep(0.01)
        self.killed = True
        self._started = False
        return pid

    def in_recovery(self) -> bool:
        return bool(self.execute("SELECT pg_is_in_recovery()")[0][0])

    def replication_state(self) -> list[tuple[str, str, str]]:
        """(application_name, state, sync_state) of each standby connected."""
        return [tuple(row) for row in self.execute(
            "SELECT application_name, state, sync_state FROM pg_stat_replication")]


class StandbyCluster(ReplicatedCluster):
    """A streaming standby of `primary`: its data is a pg_basebackup -R of the
    primary's, streaming under `name` (primary_conninfo's application_name).
    Like the primary, it can stream to standbys of its own once promoted."""

    def __init__(self, primary: TemporaryCluster, *, name: str = "standby", durable: bool = True,
                 settings: dict[str, str] | None = None, upstream_port: int | None = None):
        super().__init__(durable=durable, settings=settings)
        self.primary = primary
        self.name = name
        # where it streams from: the primary's port, or a relay's in front of it
        self.upstream_port = upstream_port or primary.port

    def start(self) -> "StandbyCluster":
        if not self.data.exists():
            if self.account:
                shutil.chown(self.root, user=self.account)
            source = (f"host=127.0.0.1 port={self.primary.port} user=postgres "
                      f"application_name={self.name}")
            self._run(self.bindir / "pg_basebackup", "-d", source, "-D", self.data, "-R",
                      "-X", "stream", "-c", "fast", "--no-sync")
            # -R wrote a primary_conninfo too; this later line is the one that counts
            with open(self.data / "postgresql.auto.conf", "a") as conf:
                conf.write(f"primary_conninfo = 'host=127.0.0.1 port={self.upstream_port} "
                           f"user=postgres application_name={self.name}'\n")
        TemporaryCluster.start(self)
        return self

    def promote(self, timeout: float = 60.0) -> float:
        """pg_ctl promote, then wait until pg_is_in_recovery() is false; the
        seconds it took."""
        started = time.monotonic()
        self._run(self.bindir / "pg_ctl", "-D", self.data, "-w", "-t", str(int(timeout)),
                  "promote")
        deadline = started + timeout
        while True:
            with contextlib.suppress(psycopg.OperationalError):
                if not self.in_recovery():
                    return time.monotonic() - started
            if time.monotonic() > deadline:
                raise errors.DatabaseUnavailable(f"the standby on port {self.port} was still in "
                                                 f"recovery {timeout:g} s after pg_ctl promote")
            time.sleep(0.02)

    def wait_streaming(self, *, synchronous: bool = False, timeout: float = 60.0) -> None:
        """Wait until the primary shows this standby streaming (and, if
        `synchronous`, as its synchronous standby)."""
        deadline = time.monotonic() + timeout
        while True:
            for name, state, sync_state in self.primary.replication_state():
                if name == self.name and state == "streaming" and (
                        not synchronous or sync_state == "sync"):
                    return
            if time.monotonic() > deadline:
                raise errors.DatabaseUnavailable(
                    f"standby {self.name!r} not streaming{' synchronously' if synchronous else ''}"
                    f" after {timeout:g} s: {self.primary.replication_state()}")
            time.sleep(0.05)

    def wait_replayed(self, timeout: float = 60.0) -> None:
        """Wait until this standby has replayed everything the primary has written."""
        target = self.primary.execute("SELECT pg_current_wal_lsn()::text")[0][0]
        deadline = time.monotonic() + timeout
        while not self.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,))[0][0]:
            if time.monotonic() > deadline:
                raise errors.DatabaseUnavailable(f"standby {self.name!r} has not replayed "
                                                 f"{target} after {timeout:g} s")
            time.sleep(0.05)


def standby_of(primary: ReplicatedCluster, *, synchronous: bool | str = False,
               name: str = "standby", durable: bool = True,
               settings: dict[str, str] | None = None,
               upstream_port: int | None = None) -> StandbyCluster:
    """A started streaming standby of `primary` (a running ReplicatedCluster).

    `synchronous`: False (asynchronous replication), True (synchronous_commit =
    on: a commit returns once the standby has flushed its WAL) or one of
    SYNCHRONOUS_COMMIT ("remote_apply": once it has applied it). Synchronous
    mode is set on the primary with ALTER SYSTEM after the base backup (so the
    standby, once promoted, does not wait for a standby of its own): the
    primary must not have synchronous_commit or synchronous_standby_names on
    its command line (a TemporaryCluster with durable=False has
    synchronous_commit=off there: refused). `upstream_port`: stream through a
    relay listening there (that forwards to the primary's port), not straight
    from the primary. Returns once the standby streams (synchronously, if
    asked)."""
    mode = "on" if synchronous is True else synchronous
    if mode and mode not in SYNCHRONOUS_COMMIT:
        raise ValueError(f"synchronous must be a bool or one of {SYNCHRONOUS_COMMIT}: {mode!r}")
    if mode and {"synchronous_commit", "synchronous_standby_names"} & set(primary.settings):
        raise ValueError("synchronous replication is set by standby_of with ALTER SYSTEM: the "
                         "primary must not fix synchronous_commit or synchronous_standby_names "
                         f"on its command line (it has {primary.settings})")
    standby = StandbyCluster(primary, name=name, durable=durable, settings=settings,
                             upstream_port=upstream_port)
    try:
        standby.start()
        standby.wait_streaming()
        if mode:
            primary.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
            primary.execute(f"ALTER SYSTEM SET synchronous_commit = '{mode}'")
            primary.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 30
            while primary.execute("SHOW synchronous_commit")[0][0] != mode or \
                    primary.execute("SHOW synchronous_standby_names")[0][0] != name:
                if time.monotonic() > deadline:
                    raise errors.DatabaseUnavailable("the primary did not take the synchronous "
                                                     "settings within 30 s")
                time.sleep(0.02)
            standby.wait_streaming(synchronous=True)
    except BaseException:
        standby.stop()
        raise
    return standby


def multi_host_url(clusters: list[TemporaryCluster], dbname: str, *,
                   target_session_attrs: str = "read-write") -> str:
    """A libpq multi-host URL over `clusters` (tried in order; with
    target_session_attrs=read-write, a standby is skipped): the URL services
    use to follow a failover."""
    hosts = ",".join(f"127.0.0.1:{c.port}" for c in clusters)
    return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs={target_session_attrs}"
