"""The long-running services (layer 5): `service` (what every service shares:
signals, wake-ups, reconnects), `worker/` (the run loop, its executors, the
quarantine process, supervisor, blame, horizon), `scheduler`, `dispatcher` (its
channels are agent_inbox.channels, a public module), `ingest/` (the webhook intake), `console/` (the web console).
They reach the database through `api/`.
"""
