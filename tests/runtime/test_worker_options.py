"""The worker's options: bad values get a specific error and nothing starts;
flags of the previous runtime are refused with a message that says what
replaced them. And `ctx.lease_lost`, which threads wait on and coroutines await."""

import asyncio
import subprocess
import sys
import threading

import pytest

from agent_inbox import InvalidInput
from agent_inbox.agent.handler import LeaseLostSignal
from agent_inbox.services.worker import Worker

from tests.runtime.support import ROOT, worker_args


@pytest.mark.parametrize("flag, value", [("--isolation", "thread"),
                                         ("--max-users-per-take", "8")])
def test_a_removed_flag_is_refused_with_what_replaced_it(flag, value):
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url",
                           "postgresql://nowhere.invalid/x", "--handler", "tests.runtime.handlers:echo",
                           flag, value], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{flag} must" not in done.stderr and "was removed" in done.stderr
    assert "--quarantine" in done.stderr


@pytest.mark.parametrize("options, message", [
    ({"concurrency": 0}, "concurrency must be"),
    ({"run_timeout": 0}, "run_timeout must be a positive number of seconds"),
    ({"run_timeout": "15m"}, "run_timeout must be a positive number of seconds"),
    ({"quarantine": 0}, "quarantine must be"),
    ({"compact_held_for": 0}, "compact_held_for must be a positive number of seconds"),
    ({"compact_held_for": "10s"}, "compact_held_for must be a positive number of seconds"),
])
def test_bad_worker_options_are_refused(inbox, options, message):
    with pytest.raises(InvalidInput, match=message):
        Worker(inbox, "tests.runtime.handlers:echo", **options)


def test_a_bad_max_batch_is_refused(make_inbox):
    with pytest.raises(InvalidInput, match="max_batch must be"):
        make_inbox(max_batch=0)


def test_the_worker_command_exits_2_on_a_bad_run_timeout(database_url, spawn):
    process = spawn(*worker_args(database_url, "echo", "--run-timeout", "0"))
    assert process.wait(timeout=60) == 2                 # the supervisor does not restart it
    assert "run_timeout must be a positive number of seconds" in process.stdout.read()


def test_lease_lost_wakes_a_coroutine_and_a_thread_when_set_from_another_thread():
    lost = LeaseLostSignal()
    seen = []

    async def agent():
        waiter = asyncio.ensure_future(_await(lost))
        await asyncio.sleep(0)                          # the waiter is registered, waiting
        assert not waiter.done()
        threading.Thread(target=lost.set).start()       # set from another thread
        seen.append(await asyncio.wait_for(waiter, 10))
        seen.append(await asyncio.wait_for(_await(lost), 10))   # already set: at once

    asyncio.run(agent())
    assert seen == [True, True]
    assert lost.is_set() and lost.wait(0)
    assert not LeaseLostSignal().wait(0.01)


async def _await(lost):
    return await lost
