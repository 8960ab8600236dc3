"""The demo's eight failure scenarios on the Citus cluster print the
reference demo's lines (demo.scenarios, run on a distributed database)."""

from pathlib import Path

from agent_inbox.dev import demo

EXPECTED = Path(__file__).parent.parent / "data" / "expected_demo_output.txt"


def test_the_demo_on_citus_prints_the_reference_lines(inbox):
    lines = []
    demo.scenarios(inbox, say=lambda *words: lines.append(" ".join(map(str, words))))
    assert lines == EXPECTED.read_text().splitlines()
