"""A pool's reconnects after its server is gone (db.CappedBackoff): psycopg_pool's
1 s, doubling, but never more than db.RECONNECT_CAP seconds apart, and jittered
once capped, so that the next attempt after a long failover comes soon after
the new primary is up, and a fleet's pools do not retry in step. (The failover
test measures it on real processes: tests/failover/test_failover.py.)"""

from agent_inbox import db


def test_the_delays_double_up_to_the_cap_and_stay_below_it_jittered():
    attempt = db.CappedBackoff(timeout=300)
    delays = []
    for now in range(40):
        attempt.update_delay(float(now))
        delays.append(attempt.delay)
    assert 0.9 <= delays[0] <= 1.1 and 1.8 <= delays[1] <= 2.2 and 3.6 <= delays[2] <= 4.4
    capped = delays[3:]
    assert all(db.RECONNECT_CAP / 2 <= d <= db.RECONNECT_CAP for d in capped), capped
    assert len(set(capped)) > 1  # jittered

