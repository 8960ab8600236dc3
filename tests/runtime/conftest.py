"""Service processes for the runtime tests, killed at teardown."""

import subprocess
import sys

import pytest

from tests.runtime.support import ROOT


@pytest.fixture
def spawn():
    """Start `agent-inbox ...` processes; kill whatever is left at teardown."""
    started = []

    def start(*args):
        process = subprocess.Popen([sys.executable, "-m", "agent_inbox.cli", *args], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        process.stdout.close()
