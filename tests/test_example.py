"""The example agent (examples/support_agent) end to end, as a newcomer runs it:
a real worker process with --app, a fake LLM server over HTTP, memory, a limit,
durable steps and a refund that waits for a person's approval."""

from examples.support_agent.__main__ import main


def test_the_support_agent_runs_end_to_end(server_url, capsys):
    assert main(["--database-url", server_url]) == 0
    out = capsys.readouterr().out
    assert "a person approves permit:refund:" in out
    assert "  outbox  : Thanks for writing! How can I help?" in out
    assert "  outbox  : Order 881 is refunded." in out
    assert "  permit  : refund -> allow (default:refund answered yes)" in out
    assert "  permit  : refund -> ask (default:refund)" in out
    assert "LLM calls paid: 2" in out  # each LLM step paid once
