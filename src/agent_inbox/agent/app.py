"""An agent as the worker runs it: its handler, what it opens and closes around
its runs, and the defaults it declares.

    app = agent_inbox.App(handle, on_startup=[open_client], on_shutdown=[close_client],
                          policies={"refund": "ask", "search": "allow"})

    agent-inbox worker --app myapp.agent:app

- `handler`: `handle(batch, ctx)` or `async def handle(batch, ctx)` (handler.py).
- `on_startup` hooks run once per runtime process before its first run, and once
  in each quarantine process before its first run there; `on_shutdown` hooks
  after the last run of that process. An `async def` hook runs on the event loop
  the handlers run on, so a client it opens (an HTTP or LLM SDK client with a
  connection pool) serves every run; a plain one is called in the process.
  A startup hook that raises stops the runtime (exit 2: bad configuration).
- `policies`: default rules (tool -> 'allow', 'deny' or 'ask') stored when the
  runtime starts if the database has no default rule for that tool yet: an
  operator's `agent-inbox policy set --default` wins over the app's.
- `limits`: default fleet limits (name -> `Limit`), stored the same way if the
  database has none of that name yet.

`--handler module:function` keeps working: it is an App with that handler alone.
"""

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from agent_inbox import errors
from agent_inbox.store import policies as policy_store


@dataclass(frozen=True)
class Limit:
    """A fleet limit's default: `rate` calls per `per` seconds, at most `burst` at once."""

    rate: int
    per: int = 1
    burst: int | None = None


@dataclass(frozen=True)
class App:
    handler: Callable
    on_startup: Sequence[Callable] = ()
    on_shutdown: Sequence[Callable] = ()
    policies: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, Limit] = field(default_factory=dict)

    def __post_init__(self):
        if not callable(self.handler):
            raise errors.InvalidInput("App handler", self.handler, "is not callable")
        for name in ("on_startup", "on_shutdown"):
            hooks = getattr(self, name)
            if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence):
                raise errors.InvalidInput(f"App {name}", hooks, "must be a list of callables")
            for hook in hooks:
                if not callable(hook):
                    raise errors.InvalidInput(f"App {name} item", hook, "is not callable")
        for tool, answer in dict(self.policies).items():
            if answer not in policy_store.ANSWERS:
                raise errors.InvalidInput(f"App policies[{tool!r}]", answer,
                                          f"must be one of {', '.join(policy_store.ANSWERS)}")
        for name, limit in dict(self.limits).items():
            if not isinstance(limit, Limit):
                raise errors.InvalidInput(f"App limits[{name!r}]", limit,
                                          "must be an agent_inbox.Limit")

    def start(self, await_on: Callable) -> None:
        """Run the startup hooks, in order; `await_on(awaitable)` runs an async
        hook's coroutine to its end on the handlers' event loop."""
        for hook in self.on_startup:
            _call(hook, await_on)

    def stop(self, await_on: Callable) -> None:
        """Run the shutdown hooks, in order; one that raises does not stop the
        others (the first failure is raised after)."""
        failures = []
        for hook in self.on_shutdown:
            try:
                _call(hook, await_on)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]


def _call(hook: Callable, await_on: Callable) -> None:
    outcome = hook()
    if inspect.isawaitable(outcome):
        await_on(outcome)


def as_app(target: Callable, reference: str) -> App:
    """What `--app`/`--handler` named, as an App."""
    if isinstance(target, App):
        return target
    if isinstance(target, type):  # a class is callable, but is no handler
        raise errors.InvalidInput("handler", reference, "names a class, not a handler or an App")
    return App(target)
