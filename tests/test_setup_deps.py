"""tests/setup-deps.sh (what `./dev test` and .ci/run call before pytest)
against a fake machine: a PATH holding only links to the few real tools it
needs plus a fake `id`, `apt-get` and `pg_ctl`, a fake PostgreSQL layout and a
fake shared/citus/ whose install.sh records its call. Nothing is installed.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from agent_inbox.dev import pgserver
from tests import pgbouncer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "setup-deps.sh"
TOOLS = ["bash", "env", "dirname", "basename", "realpath", "ls", "sort", "grep", "tail",
         "mktemp", "rm", "cp", "mkdir", "touch", "chmod", "cat"]

FAKE_APT = """#!/usr/bin/env bash
echo "apt-get $*" >>"$FAKE_ROOT/calls"
if [ "$1" = install ]; then
  for p in "$@"; do
    case "$p" in
      pgbouncer) touch "$FAKE_ROOT/bin/pgbouncer"; chmod +x "$FAKE_ROOT/bin/pgbouncer" ;;
      chromium) mkdir -p "$FAKE_ROOT/usr/bin"; touch "$FAKE_ROOT/usr/bin/chromium" ;;
    esac
  done
fi
"""
FAKE_INSTALL_SH = """#!/usr/bin/env bash
echo "install.sh $* in $PWD" >>"$FAKE_ROOT/calls"
ls >>"$FAKE_ROOT/calls"
mkdir -p "$FAKE_ROOT/usr/lib/postgresql/15/lib" "$FAKE_ROOT/usr/share/postgresql/15/extension"
touch "$FAKE_ROOT/usr/lib/postgresql/15/lib/citus.so"
touch "$FAKE_ROOT/usr/share/postgresql/15/extension/citus.control"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


class Machine:
    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in TOOLS:
            (self.bin / tool).symlink_to(shutil.which(tool))
        self.uid = "0"
        _executable(self.bin / "id", '#!/usr/bin/env bash\necho "$FAKE_UID"\n')
        _executable(self.bin / "apt-get", FAKE_APT)
        pg = root / "usr/lib/postgresql/15/bin"
        pg.mkdir(parents=True)
        for name in ("initdb", "postgres", "pg_ctl"):
            _executable(pg / name, "#!/bin/sh\n")
        (self.bin / "pg_ctl").symlink_to(pg / "pg_ctl")
        self.shared = root / "shared"
        (self.shared / "citus").mkdir(parents=True)
        (self.shared / "citus/citus-pg15-9.9.9.tar.gz").write_text("not a tarball")
        (self.shared / "citus/citus-pg15-9.9.9.tar.gz.sha256").write_text("-")
        _executable(self.shared / "citus/install.sh", FAKE_INSTALL_SH)
        self.tmp = root / "tmp"
        self.tmp.mkdir()

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        environment = {"PATH": str(self.bin), "HOME": str(self.root), "TMPDIR": str(self.tmp),
                       "FAKE_ROOT": str(self.root), "FAKE_UID": self.uid,
                       "AGENT_INBOX_SHARED_DIR": str(self.shared),
                       "AGENT_INBOX_TEST_CHROMIUM": str(self.root / "usr/bin/chromium"), **env}
        return subprocess.run([str(self.bin / "bash"), str(SCRIPT), *args], env=environment,
                              capture_output=True, text=True, timeout=20)

    def calls(self) -> list[str]:
        path = self.root / "calls"
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path)


def _skip_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if "skipping" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("test set-up: skipping ")
    return lines[0]


def test_as_root_with_apt_installs_what_is_missing_then_nothing(machine):
    done = machine.run("--require-all")
    assert done.returncode == 0, done.stderr
    calls = machine.calls()
    assert calls[:2] == ["apt-get update", "apt-get install -y pgbouncer chromium"]
    # install.sh runs on a copy (shared/ may be read-only), given the tarball
    assert calls[2].startswith("install.sh ./citus-pg15-9.9.9.tar.gz in ")
    assert not calls[2].endswith(str(machine.shared / "citus"))
    assert calls[3:] == ["citus-pg15-9.9.9.tar.gz", "citus-pg15-9.9.9.tar.gz.sha256",
                         "install.sh"]
    assert "skipping" not in done.stderr
    assert "no suite is skipped" in done.stderr
    assert list(machine.tmp.iterdir()) == []  # its copy and log are gone

    again = machine.run("--require-all")
    assert again.returncode == 0, again.stderr
    assert machine.calls() == calls  # all present: nothing called


def test_only_what_is_missing_is_installed(machine):
    _executable(machine.bin / "pgbouncer", "#!/bin/sh\n")
    (machine.root / "usr/lib/postgresql/15/lib").mkdir(parents=True)
    (machine.root / "usr/lib/postgresql/15/lib/citus.so").touch()
    (machine.root / "usr/share/postgresql/15/extension").mkdir(parents=True)
    (machine.root / "usr/share/postgresql/15/extension/citus.control").touch()
    done = machine.run()
    assert done.returncode == 0, done.stderr
    assert machine.calls() == ["apt-get update", "apt-get install -y chromium"]


def test_not_root_installs_nothing_and_names_every_skipped_suite(machine):
    machine.uid = "1000"
    done = machine.run()
    assert done.returncode == 0, done.stderr
    assert machine.calls() == []
    line = _skip_line(done)
    for suite in ("tests/behind_pgbouncer", "tests/console", "tests/citus",
                  "tests/contract[pgbouncer]", "tests/contract[citus]"):
        assert suite in line
    assert line.endswith("to run them: sudo tests/setup-deps.sh")
    # CI's mode: what is missing fails the run
    assert machine.run("--require-all").returncode == 1


def test_without_apt_or_shared_it_says_what_would_enable_them(machine):
    (machine.bin / "apt-get").unlink()
    shutil.rmtree(machine.shared)
    done = machine.run()
    assert done.returncode == 0, done.stderr
    assert machine.calls() == []
    line = _skip_line(done)
    assert "install pgbouncer with the system's package manager" in line
    assert "install chromium with the system's package manager" in line
    assert f"put shared/ (with citus/citus-pg15-*.tar.gz) at {machine.shared}" in line


def test_opt_out_installs_nothing(machine):
    done = machine.run(AGENT_INBOX_TEST_NO_INSTALL="1")
    assert machine.calls() == []
    assert _skip_line(done).endswith("to run them: unset AGENT_INBOX_TEST_NO_INSTALL")


def test_the_tests_own_checks_agree_with_the_script(machine, monkeypatch):
    """pgbouncer.available() and pgserver.citus_installed(), which decide the
    skips, see the fake machine as the script does, before and after."""
    monkeypatch.setenv("PATH", str(machine.bin))
    assert not pgbouncer.available()
    assert not pgserver.citus_installed()
    machine.run()
    assert pgbouncer.available()
    assert pgserver.citus_installed()
