"""Channels the runtime tests name as module:function (dispatcher processes
import them). Each send is recorded in files under $AGENT_INBOX_TEST_SENDS:
`started` when it begins, `sent` when it returns."""

import os
import time


def _record(name: str, key: str) -> None:
    with open(os.path.join(os.environ["AGENT_INBOX_TEST_SENDS"], name), "a") as log:
        log.write(key + "\n")


def held(user, text, key):
    """Returns once the file `release` exists in the sends folder."""
    _record("started", key)
    release = os.path.join(os.environ["AGENT_INBOX_TEST_SENDS"], "release")
    while not os.path.exists(release):
        time.sleep(0.02)
    _record("sent", key)
