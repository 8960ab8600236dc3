"""The failover tests start throwaway clusters from the local PostgreSQL
binaries: without them, every test here is skipped, saying why."""

import pytest

from agent_inbox import errors
from agent_inbox.dev import pgserver


@pytest.fixture(autouse=True)
def _binaries():
    try:
        pgserver.find_bindir()
    except errors.DatabaseUnavailable as exc:
        pytest.skip(str(exc))
