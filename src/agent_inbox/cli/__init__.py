"""The command line (the top layer): `agent-inbox` and `python -m agent_inbox.cli`.

`main` (entry point and the parser, in main.py), `options` (what the commands
share, importing no command), `operator` (status, events, dead, outbox, timers,
approve, prune, memory, policy, audit), `limits`, `intake` (ingest-server),
`console`.
"""

from agent_inbox.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
