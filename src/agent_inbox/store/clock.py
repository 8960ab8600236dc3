"""One clock for every host: the database server's.

Every comparison with a lease expiry, a due time, a deadline or an outbox gap is
made in SQL against NOW, which is the caller's explicit `now` (tests,
simulations) or else the server's clock read at the moment the statement runs
(clock_timestamp, not the transaction's start, so a wait on a lock never makes
the clock look earlier than it is).
"""

DB_CLOCK = "floor(extract(epoch FROM clock_timestamp()))::bigint"
NOW = f"coalesce(%(now)s::bigint, {DB_CLOCK})"
