"""Example agents, each runnable with `python -m examples.<name>` from the repository's top."""
