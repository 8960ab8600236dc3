"""The API over a backend (layer 4): the `Inbox` and what the services use.

`inbox` (the Inbox), `runs` (taking, finishing and releasing runs),
`scheduling` (timers and approvals), `delivery` (the outbox's sends),
`permissions` (policies and decisions), `limits` (fleet-wide limits and the
process's Limiter), `admin` (operator views the CLI and the console share).
"""
