"""Citus clusters for the tests of this folder: started from the local
binaries, skipped (saying why) only where the extension is not installed."""

import contextlib
from collections.abc import Iterator

import pytest

from agent_inbox import citus, migrate, pgserver


@contextlib.contextmanager
def started_cluster() -> Iterator[pgserver.CitusCluster]:
    """A coordinator and two worker nodes for the block."""
    if not pgserver.citus_installed():
        pytest.skip("the Citus extension is not installed for the local PostgreSQL "
                    "(tests/setup-deps.sh, which ./dev test runs, installs it from "
                    "../shared/citus/ when run as root)")
    with pgserver.CitusCluster(workers=2) as cluster:
        yield cluster


def distributed_database(cluster: pgserver.CitusCluster) -> str:
    """A fresh database on every node, migrated and laid out as `migrate
    --citus` does (the ordinary migrations, then citus.distribute); its URL."""
    url = cluster.create_database()
    migrate.upgrade(url)
    citus.distribute(url)
    return url
