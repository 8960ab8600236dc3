"""The console's compose service, checked without a Docker engine (as
tests/test_compose.py checks the others): on the compose network only, its
command and environment the CLI's own, its tokens from a declared secret."""

import pytest

from tests.test_compose import compose, environment, interpolate, services  # noqa: F401 (fixtures)

yaml = pytest.importorskip("yaml")


def test_the_console_listens_on_the_compose_network_only(services):
    console = services["console"]
    assert "ports" not in console  # nothing published on the host
    assert console["expose"] == ["8081"]
    env = environment(console)
    assert (env["AGENT_INBOX_CONSOLE_HOST"], env["AGENT_INBOX_CONSOLE_PORT"]) == ("0.0.0.0", "8081")
    assert "8081/healthz" in " ".join(console["healthcheck"]["test"])


def test_the_console_reads_its_tokens_from_a_declared_secret(compose, services, monkeypatch):
    from agent_inbox import cli

    console = services["console"]
    assert console["secrets"] == ["console_tokens"]
    declared = compose["secrets"]["console_tokens"]["file"]
    assert interpolate(declared) == "/dev/null"  # none by default: it refuses to start
    assert interpolate(declared, {"AGENT_INBOX_CONSOLE_TOKENS_PATH": "./t"}) == "./t"
    for name, value in environment(console).items():
        monkeypatch.setenv(name, interpolate(value))
    args = cli.build_parser().parse_args(console["command"])
    assert (args.command, args.host, int(args.port), args.tokens_file) == (
        "console", "0.0.0.0", 8081, "/run/secrets/console_tokens")
