"""A real PostgreSQL for every test, and an isolated database per test.

The server: AGENT_INBOX_TEST_DATABASE_URL if set; else a testcontainers
PostgreSQL when a Docker engine answers a quick probe; else a throwaway cluster
started from the local PostgreSQL binaries. Each test gets a fresh database
copied from a migrated template (CREATE DATABASE ... TEMPLATE), dropped after.
"""

import contextlib
import os

import pytest

from agent_inbox import Inbox, migrate, pgserver


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Skip reasons always in the summary (-rs on top of pyproject's -ra, or of
    any -r given), so that a partial run never reads as a full one."""
    config.option.reportchars = (config.option.reportchars or "") + "s"


def _docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@pytest.fixture(scope="session")
def server_url():
    url = os.environ.get("AGENT_INBOX_TEST_DATABASE_URL")
    if url:
        yield url
    elif _docker_engine_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver=None) as container:
            yield container.get_connection_url()
    else:
        with pgserver.TemporaryCluster() as cluster:
            yield cluster.url


@pytest.fixture(scope="session")
def template_name(server_url):
    url = pgserver.create_database(server_url, prefix="agent_inbox_template")
    migrate.upgrade(url)
    yield pgserver.conninfo.conninfo_to_dict(url)["dbname"]
    pgserver.drop_database(url)


@pytest.fixture
def database_url(server_url, template_name):
    """A fresh, migrated database for this test alone."""
    url = pgserver.create_database(server_url, prefix="agent_inbox_test", template=template_name)
    yield url
    pgserver.drop_database(url)


@pytest.fixture
def empty_database_url(server_url):
    """A fresh database with no schema at all."""
    url = pgserver.create_database(server_url, prefix="agent_inbox_empty")
    yield url
    pgserver.drop_database(url)


@pytest.fixture
def inbox(database_url):
    with Inbox.connect(database_url, pool_size=4) as opened:
        yield opened


@pytest.fixture
def make_inbox(database_url):
    """Open more Inbox objects on the test's database (one per simulated process)."""
    with contextlib.ExitStack() as stack:
        def make(**options) -> Inbox:
            options.setdefault("pool_size", 1)
            return stack.enter_context(Inbox.connect(database_url, **options))

        yield make
