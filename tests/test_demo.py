"""Demo parity: `agent-inbox demo` prints exactly the reference demo's lines."""

import subprocess
import sys
from pathlib import Path

import pytest

from agent_inbox.dev import pgserver

HERE = Path(__file__).parent
EXPECTED = HERE / "data" / "expected_demo_output.txt"
SEED_EXPECTED = HERE.parent.parent / "shared" / "seed" / "expected_demo_output.txt"


def _demo(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", "demo", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_demo_prints_the_reference_lines_on_a_given_server(server_url):
    assert _demo("--database-url", server_url) == EXPECTED.read_text().splitlines()


def test_demo_leaves_no_database_behind(server_url):
    import psycopg

    def demo_databases():
        with psycopg.connect(server_url, autocommit=True) as conn:
            return conn.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE 'agent_inbox_demo%'").fetchall()

    before = demo_databases()
    _demo("--database-url", server_url)
    assert demo_databases() == before


def test_demo_without_a_url_starts_and_removes_a_throwaway_cluster():
    try:
        pgserver.find_bindir()
    except Exception as exc:  # no local binaries: this path cannot run here
        pytest.skip(str(exc))
    leftovers = set(Path("/tmp").glob("agent-inbox-pg-*"))
    assert _demo() == EXPECTED.read_text().splitlines()
    assert set(Path("/tmp").glob("agent-inbox-pg-*")) <= leftovers


@pytest.mark.skipif(not SEED_EXPECTED.exists(), reason="shared/seed not beside the checkout")
def test_the_copied_expected_output_is_the_seed_s():
    assert EXPECTED.read_text() == SEED_EXPECTED.read_text()
