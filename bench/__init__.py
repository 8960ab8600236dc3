"""The agent-inbox benchmark suite: `python -m bench.run` (see bench/README.md)."""
