"""`Inbox` is a facade: the user's calls are its own, the services' protocols
are typed objects it holds, and nothing is mixed in (api/inbox.py)."""

import inspect

from agent_inbox import Inbox
from agent_inbox.api.delivery import Delivery
from agent_inbox.api.runs import Runs
from agent_inbox.api.scheduling import Scheduling


def public(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_inbox_mixes_nothing_in():
    assert Inbox.__bases__ == (object,)


def test_the_services_protocols_are_not_inbox_calls():
    for protocol in (Runs, Delivery, Scheduling):
        assert public(protocol) & public(Inbox) == set(), protocol.__name__


def test_the_inbox_holds_each_protocol_on_the_path_it_is_given():
    path = object()                              # no database: the objects only hold it
    inbox = Inbox(object(), path=path, lease_ttl=30)
    for attribute, protocol in (("runs", Runs), ("delivery", Delivery),
                                ("scheduling", Scheduling)):
        held = getattr(inbox, attribute)
        assert isinstance(held, protocol) and held._path is path, attribute
    assert inbox.runs._settings is inbox.settings and inbox.settings.lease_ttl == 30
