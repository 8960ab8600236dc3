"""The notification channels that wake services (LISTEN/NOTIFY).

A notification is only a hint to look now: services also poll, so a lost one
delays work by at most a polling interval and never loses it.
"""

WORK = "agent_inbox_work"      # events inserted (the events_inserted trigger)
TIMERS = "agent_inbox_timers"  # timers created or replaced
OUTBOX = "agent_inbox_outbox"  # messages queued by a finished run
CANCEL = "agent_inbox_cancel"  # a run fenced off by an operator: {"user", "gen"} (store/pauses.py)
