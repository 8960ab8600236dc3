"""PostgreSQL fails over: a durable primary streaming to a standby is SIGKILLed
with runs in flight, the standby is promoted, and the services (two workers and
a dispatcher as processes, on the libpq multi-host URL) carry on by themselves.
tests/failover/scenario.py runs it and counts what was lost, repeated or kept;
`python -m bench.failover` runs the same for each replication mode.

The replication link is held for a second before the kill (a standby that
lags), so an asynchronous standby really misses the primary's last commits.
With a synchronous standby nothing acknowledged may be lost: every event
acknowledged to the feeder is stored and done, no run whose finish its worker
saw acknowledged runs again, no send whose mark its dispatcher saw
acknowledged goes again, no key names two batches, and runs complete within
15 s of the promotion. With an asynchronous one the figures are reported.

With synchronous_commit = on the promotion comes 16 s after the kill (a
failover manager's usual wait), long enough for psycopg_pool's own backoff
(1 s, doubling, uncapped) to put the services' next attempt 15 s after the
promotion: runs must resume within RECONNECT_CAP (db.py) and a little of it.
The other modes promote after 1 s. No service process makes more than a few
connection attempts a second meanwhile (a backoff, not a storm).
"""

import json

import pytest

from agent_inbox import db
from tests.failover import scenario


# Connection attempts per second one service process may make while no
# primary answers: its pool's connections each retried at most every
# RECONNECT_CAP / 2 s once capped, and once each at once when lost.
STORM = 5


@pytest.mark.parametrize("replication, promote_after", [("on", 16.0), ("remote_apply", 1.0)])
def test_with_a_synchronous_standby_a_failover_loses_and_repeats_nothing_acknowledged(
        replication, promote_after):
    figures = scenario.run(scenario.Config(replication=replication, promote_after=promote_after,
                                           deadline=90))
    print(json.dumps({k: v for k, v in figures.items() if k != "config"}))
    assert figures["lost"] == 0, figures["lost_keys"]
    assert figures["handled"] == figures["events"] == 300
    assert figures["runs_repeated"] == 0, figures["runs_repeated_keys"]
    assert figures["effects_repeated"] == 0
    assert figures["sent_twice_after_ack"] == 0
    assert figures["keys_reused"] == 0
    # A same-key resend needs a send whose mark-sent was not acknowledged when
    # the primary died (at-least-once delivery): not one in these runs.
    assert figures["sent_twice"] == 0
    assert figures["dead"] == 0
    assert figures["recovery_after_promotion_s"] < min(15, db.RECONNECT_CAP + 5), figures
    assert figures["timers_lost"] == figures["timers_repeated"] == 0
    assert figures["reconnect_attempts_per_s"] <= STORM, figures
    assert set(figures["exit_codes"].values()) == {0}


def test_with_an_asynchronous_standby_a_failover_loses_the_lag_and_the_figures_say_what(
        capsys):
    figures = scenario.run(scenario.Config(replication="async", deadline=90))
    with capsys.disabled():
        print("\nasync failover:", json.dumps({k: v for k, v in figures.items()
                                              if k != "config"}))
    # Not asserted zero: what was acknowledged in the lag is gone. Everything
    # acknowledged is either done or lost, nothing is left stuck, and the fleet
    # recovered on its own.
    assert figures["handled"] + figures["lost"] + figures["dead"] == figures["events"] == 300
    assert figures["lost"] <= figures["events"]
    assert figures["recovery_after_promotion_s"] < 15, figures
    assert figures["timers_lost"] == 0
    assert figures["reconnect_attempts_per_s"] <= STORM, figures
    assert set(figures["exit_codes"].values()) == {0}
