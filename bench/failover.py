"""PostgreSQL fails over: what is lost, repeated or kept, per replication mode.

    .venv/bin/python -m bench.failover [--modes async,on,remote_apply] [--events 300]
        [--rate 30] [--promote-after 1] [--lag 1] [--out FILE]

Runs tests/failover/scenario.py once per mode: a durable throwaway primary
streaming to one standby (asynchronously, or synchronously with
synchronous_commit = on or remote_apply), two workers, a scheduler and a
dispatcher as processes on the libpq multi-host URL, a feeder ingesting
--events events at --rate per second; the replication link held --lag seconds,
then the primary SIGKILLed with runs in flight, the standby promoted
--promote-after seconds later; nothing restarted. Per mode: events
acknowledged to the feeder, handled (done), lost (acknowledged, absent after
the failover), runs_repeated (handled again after a finish its worker saw
acknowledged), sent_twice (outbox keys handed to the channel twice; of those
sent_twice_after_ack: a mark-sent acknowledged, then lost), keys_reused (a key
handed out for two different texts), timers_repeated, recovery_s (kill to the
first run completed on the new primary; recovery_after_promotion_s from the
promotion). The scenario's module docstring defines each figure.

Prints a line per mode as it ends, then, last, one JSON line per mode; writes
every figure, the configuration and the machine to bench/results/failover.json.
Exits 1 if a synchronous mode lost or sent twice anything acknowledged.
"""

import argparse
import json
import os
import platform
import sys
import time

import psycopg

from bench.common import RESULTS, src_fingerprint
from tests.failover import scenario

BRIEF = ("replication", "events", "handled", "lost", "runs_repeated", "sent_twice",
         "recovery_s", "recovery_after_promotion_s", "sent_twice_after_ack", "keys_reused",
         "timers_repeated", "reconnect_attempts_per_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(scenario.MODES),
                        help=f"comma-separated, of {', '.join(scenario.MODES)}")
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--rate", type=float, default=30.0, help="events/s the feeder ingests")
    parser.add_argument("--promote-after", type=float, default=1.0,
                        help="seconds from the kill to pg_ctl promote")
    parser.add_argument("--lag", type=float, default=1.0,
                        help="seconds the replication link is held before the kill")
    parser.add_argument("--out", default=str(RESULTS / "failover.json"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(scenario.MODES):
        parser.error(f"--modes: of {', '.join(scenario.MODES)}")

    started = time.monotonic()
    info = {"nproc": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
            "python": platform.python_version(), "psycopg": psycopg.__version__,
            "postgresql_bindir": str(scenario.pgserver.find_bindir()),
            "agent_inbox_code": src_fingerprint()}
    runs = []
    for mode in modes:
        config = scenario.Config(replication=mode, events=args.events, rate=args.rate,
                                 kill_after=args.events // 3, promote_after=args.promote_after,
                                 lag=args.lag, deadline=max(90.0, 3 * args.events / args.rate))
        figures = scenario.run(config, log=lambda line: print(line, file=sys.stderr, flush=True))
        runs.append(figures)
        print(f"{mode:>12}: {figures['events']} acknowledged, {figures['lost']} lost, "
              f"{figures['runs_repeated']} runs repeated, {figures['sent_twice']} sent twice "
              f"({figures['keys_reused']} keys reused), recovery {figures['recovery_s']} s "
              f"({figures['recovery_after_promotion_s']} s after the promotion)",
              file=sys.stderr, flush=True)
    info["loadavg_at_end"] = os.getloadavg()
    promised = all(f["lost"] == f["runs_repeated"] == f["sent_twice_after_ack"] == 0
                   for f in runs if f["replication"] != "async")
    result = {"config": {**vars(args),
                         "command": "python -m bench.failover " + " ".join(sys.argv[1:])},
              "runs": runs, "synchronous_promise_held": promised, "machine": info,
              "seconds": round(time.monotonic() - started, 1)}
    with open(args.out, "w") as fh:
        fh.write(json.dumps(result, indent=2) + "\n")
    for figures in runs:
        print(json.dumps({k: figures[k] for k in BRIEF}))
    sys.exit(0 if promised else 1)


if __name__ == "__main__":
    main()
