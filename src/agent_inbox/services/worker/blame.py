"""Which run a dead runtime was executing: a small slot of memory that the
supervisor shares with its runtime child and reads after the child died.

The supervisor makes the slot (a file in /dev/shm, unlinked at once: the two
processes share it through a descriptor the child inherits) and empties it
before each child. The runtime's event loop writes in it, at every step of
every task of a run (its handler's task and the tasks that one starts), that
run's `gen:user`, and empties it when the step ends. So:

- the runtime died during a step (a segfault in a C extension the handler
  called, `os._exit`, a signal the handler sent itself, the loop blocked in a
  step and killed from outside): the slot names that run;
- it died while no task of a run was stepping (a plain handler's thread, a
  thread an async handler started, the runtime's own threads, an OOM kill
  between steps): the slot is empty, the culprit unknown.

An OOM kill (SIGKILL from outside) during a step names the run that was
stepping, which may be innocent: the release rule (runs.release_holder) bounds
what a wrong name costs.

Layout: 8 bytes of length (0: empty), then `gen:user` in UTF-8. The writer
writes the record, then its length, and empties the slot by zeroing the length,
so a reader sees a whole record or none.
"""

import asyncio
import collections.abc
import contextvars
import mmap
import os
import struct
import tempfile

SIZE = 4096
_LENGTH = struct.Struct("<Q")
# The record of the run a task belongs to (None: not a run's task).
_RUN: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("agent_inbox_run",
                                                                    default=None)


def record(user: str, gen: int) -> bytes | None:
    """The slot's record of a run; None if it does not fit (then never named)."""
    data = f"{gen}:{user}".encode()
    return data if len(data) <= SIZE - _LENGTH.size else None


def parse(text: str | None) -> tuple[str, int] | None:
    """(user, gen) from a record's text; None if it is not one."""
    gen, sep, user = (text or "").partition(":")
    return (user, int(gen)) if sep and gen.isdigit() and user else None


class Slot:
    """The shared slot, mapped from descriptor `fd`."""

    def __init__(self, fd: int):
        self.fd = fd
        self._map = mmap.mmap(fd, SIZE)

    @classmethod
    def create(cls) -> "Slot":
        """A new empty slot whose descriptor a child may inherit (pass_fds)."""
        shm = "/dev/shm"
        fd, path = tempfile.mkstemp(prefix="agent-inbox-slot-",
                                    dir=shm if os.access(shm, os.W_OK) else None)
        os.unlink(path)
        os.ftruncate(fd, SIZE)
        return cls(fd)

    def mark(self, data: bytes) -> None:
        self._map[_LENGTH.size:_LENGTH.size + len(data)] = data
        _LENGTH.pack_into(self._map, 0, len(data))

    def clear(self) -> None:
        _LENGTH.pack_into(self._map, 0, 0)

    def read(self) -> str | None:
        """The record in the slot (`gen:user`), or None if it is empty."""
        (length,) = _LENGTH.unpack_from(self._map, 0)
        if not 0 < length <= SIZE - _LENGTH.size:
            return None
        return bytes(self._map[_LENGTH.size:_LENGTH.size + length]).decode(errors="replace")

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


def enter(context: contextvars.Context, user: str, gen: int) -> None:
    """Make `context` (a run's task is started in it) that run's: the steps of
    its task, and of the tasks that one starts, are marked as that run's."""
    context.run(_RUN.set, record(user, gen))


def traced(coro, slot: Slot):
    """A new task's coroutine, marking `slot` at each step of a run's task
    (what the loop's task factory wraps); what is no coroutine is left to
    Task, which refuses it as it would without the factory."""
    return _Traced(coro, slot) if asyncio.iscoroutine(coro) else coro


class _Traced(collections.abc.Coroutine):
    """A task's coroutine, stepped with the slot naming the task's run."""

    __slots__ = ("_coro", "_slot")

    def __init__(self, coro, slot: Slot):
        self._coro, self._slot = coro, slot

    def send(self, value):
        data = _RUN.get()  # the task's context: the step runs in it
        if data is None:
            return self._coro.send(value)
        self._slot.mark(data)
        try:
            return self._coro.send(value)
        finally:
            self._slot.clear()

    def throw(self, *args):
        data = _RUN.get()
        if data is None:
            return self._coro.throw(*args)
        self._slot.mark(data)
        try:
            return self._coro.throw(*args)
        finally:
            self._slot.clear()

    def close(self):
        return self._coro.close()

    def __await__(self):
        return self._coro.__await__()

    def __getattr__(self, name):  # cr_frame, cr_code, ... for reprs and debuggers
        if name in _Traced.__slots__:
            raise AttributeError(name)
        return getattr(self._coro, name)
