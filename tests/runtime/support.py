"""Helpers for tests that run the services as processes."""

import os
import signal
import subprocess
import time

import psycopg

H = "tests.runtime.handlers"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_until(query_result, description, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = query_result()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {description}")
        time.sleep(0.05)


def scalar(url, sql, *params):
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchone()[0]


def read_until(process, text):
    """Read the process's log lines until one contains `text` (or it exits)."""
    for line in process.stdout:
        if text in line:
            return
    raise AssertionError(f"the process exited without logging {text!r}")


def worker_args(url, handler, *extra):
    return ["worker", "--database-url", url, "--handler", f"{H}:{handler}", "--log-level", "info",
            *extra]


def stop_all(processes, *, kill=lambda process: process.kill()):
    """SIGTERM every process, wait for each to exit (60 s), `kill` one that
    does not; the exit codes then say how each stopped."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill(process)
            process.wait(timeout=30)
