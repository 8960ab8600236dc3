"""A small support agent on agent-inbox: see agent.py (the agent) and
__main__.py (`python -m examples.support_agent` runs it end to end)."""
