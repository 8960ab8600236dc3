"""Append-only per-process records of handler runs, shared by both systems' handlers.

Each worker process appends one JSON line per run to
`$BENCH_RECORD_DIR/<tag>-<pid>.jsonl` with a single os.write on an O_APPEND
descriptor (no buffering to lose at exit). The driver reads them back after the
workers stop, to check exactly-once handling and per-user non-overlap and to
compute W2's latencies.
"""

import json
import os
import threading

_lock = threading.Lock()
_fds: dict[str, int] = {}


def enabled() -> bool:
    return bool(os.environ.get("BENCH_RECORD_DIR"))


def write(tag: str, record: dict) -> None:
    directory = os.environ.get("BENCH_RECORD_DIR")
    if not directory:
        return
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    with _lock:
        fd = _fds.get(tag)
        if fd is None:
            path = os.path.join(directory, f"{tag}-{os.getpid()}.jsonl")
            fd = _fds[tag] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line)


def read(directory: str, tag: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(tag + "-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                out.extend(json.loads(line) for line in f if line.strip())
    return out
