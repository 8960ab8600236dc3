"""Tracing on the Citus cluster (tests/runtime/test_tracing.py's tests, run
here unchanged): the traceparent stored with each event, carried by its run
to the outbox row, through the routed statements of backend/citus/statements.py."""

import pytest

pytest.importorskip("opentelemetry.sdk")

from tests.runtime.test_tracing import (  # noqa: E402,F401 -- collected here, under this folder's fixtures
    spans,
    test_a_malformed_traceparent_is_ignored,
    test_a_run_of_several_events_is_the_first_ones_child_and_links_the_others,
    test_a_webhooks_trace_runs_through_its_run_to_its_send,
)
