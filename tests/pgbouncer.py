"""A PgBouncer of our own in `pool_mode = transaction`, in front of a server.

`PgBouncer(server_url, pool_size=N)` writes a config, auth file, log, pid file
and unix socket into one temporary directory, starts `pgbouncer` on a free
loopback port (as the `postgres` account when run as root: pgbouncer refuses
root), and waits until it answers; `stop()` ends it by its pid and removes the
directory. `url(database_url)` is the same database reached through it. Every
database of the server is served (a `*` entry), each user in trust mode: the
auth file lists the server URL's user, the only one the tests log in as.

Used by tests/behind_pgbouncer and bench/pgbouncer.py. Needs the `pgbouncer`
binary (Debian's package: 1.18).
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import conninfo

START_TIMEOUT = 10.0


def available() -> bool:
    return shutil.which("pgbouncer") is not None


def version() -> str:
    """`pgbouncer --version`'s first line ("PgBouncer 1.18.0")."""
    done = subprocess.run(["pgbouncer", "--version"], capture_output=True, text=True, timeout=10)
    return done.stdout.splitlines()[0] if done.stdout else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgBouncer:
    def __init__(self, server_url: str, *, pool_size: int, max_client_conn: int = 1000):
        target = conninfo.conninfo_to_dict(server_url)
        self.user = target.get("user") or "postgres"
        self.server = (target.get("host") or "127.0.0.1", int(target.get("port") or 5432))
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="agent-inbox-pgbouncer-"))
        self.process: subprocess.Popen | None = None
        self._stderr = None

    def _config(self) -> str:
        host, port = self.server
        return "\n".join([
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            f"unix_socket_dir = {self.root}",
            f"logfile = {self.root / 'pgbouncer.log'}",
            f"pidfile = {self.root / 'pgbouncer.pid'}",
            "auth_type = trust",
            f"auth_file = {self.root / 'users.txt'}",
            "pool_mode = transaction",
            f"default_pool_size = {self.pool_size}",
            "reserve_pool_size = 0",
            f"max_client_conn = {self.max_client_conn}",
            # a database dropped by a test leaves server connections that fail; go on
            "server_login_retry = 1",
            "",
        ])

    def start(self) -> "PgBouncer":
        (self.root / "users.txt").write_text(f'"{self.user}" ""\n')
        (self.root / "pgbouncer.ini").write_text(self._config())
        command = ["pgbouncer", str(self.root / "pgbouncer.ini")]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            account = pwd.getpwnam("postgres")
            shutil.chown(self.root, user=account.pw_uid, group=account.pw_gid)
            for path in self.root.iterdir():
                shutil.chown(path, user=account.pw_uid, group=account.pw_gid)
            command[1:1] = ["-u", "postgres"]
        # stderr to a file, never a pipe: pgbouncer writes every log line there too
        # (about 300 bytes per client login), and a pipe nobody reads fills after
        # a few hundred logins; pgbouncer then blocks on the write and stops
        # answering (the contract suite's session PgBouncers see thousands)
        self._stderr = open(self.root / "stderr.txt", "wb")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                        start_new_session=True)
        self._wait_until_it_answers()
        return self

    def _wait_until_it_answers(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                error = (self.root / "stderr.txt").read_text(errors="replace")
                self.stop()
                raise RuntimeError(f"pgbouncer exited with {self.process.returncode}: {error}"
                                   f"{self.log()}")
            try:
                with psycopg.connect(self.url(f"postgresql://{self.user}@x/postgres"),
                                     connect_timeout=2, prepare_threshold=None):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def url(self, database_url: str) -> str:
        """`database_url`'s database and user, through this PgBouncer."""
        return conninfo.make_conninfo(database_url, host="127.0.0.1", port=str(self.port))

    def log(self) -> str:
        path = self.root / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # immediate shutdown (SIGINT waits)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self._stderr is not None:
            self._stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PgBouncer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
