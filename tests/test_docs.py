"""The documentation site (mkdocs.yml, docs/): it builds in strict mode, every
section the README used to hold is in it, its generated pages cover every
command and every result file, the changelog keeps its form, and the README
stays short."""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
OLD_README = "07acc0f"  # README.md before the documentation site: 1,475 lines


def _load(name):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _headings(text: str, levels: str = "1,6") -> list[str]:
    """Markdown ATX headings outside fenced code blocks."""
    found, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        match = re.match(r"^(#{%s}) (.+?)\s*#*\s*$" % levels, line)
        if not fence and match:
            found.append(match.group(2))
    return found


def _sections() -> list[tuple[str, str, str]]:
    rows = []
    for line in (ROOT / "tests" / "readme_sections.tsv").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        heading, page, *reason = line.split("\t")
        rows.append((heading, page, reason[0] if reason else ""))
    return rows


def _old_readme() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD_README}:README.md"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"git cannot show {OLD_README}:README.md here (a shallow clone?)")
    return done.stdout


def test_every_section_of_the_old_readme_has_a_page():
    for heading, page, reason in _sections():
        if page == "-":
            assert reason, f"{heading!r} dropped without a reason"
            continue
        path = DOCS / page
        assert path.exists(), f"{heading!r}: {page} does not exist"
        assert heading in _headings(path.read_text()), f"{heading!r} is no heading of docs/{page}"


def test_the_list_is_every_heading_of_the_old_readme():
    old = _old_readme()
    listed = [heading for heading, _, _ in _sections()]
    assert listed == _headings(old, "1,3")


def test_readme_paragraphs_added_since_are_in_the_docs():
    """While README.new.md waits to replace README.md, a paragraph someone added
    to README.md since the split must have been moved into docs/ as well."""
    if not (ROOT / "README.new.md").exists():
        pytest.skip("README.md is the short one: nothing waits to be moved")

    def paragraphs(text):
        return {" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()}

    added = paragraphs((ROOT / "README.md").read_text()) - paragraphs(_old_readme())
    docs = " ".join(" ".join(p.read_text().split()) for p in DOCS.rglob("*.md"))
    docs += " ".join((ROOT / "CHANGELOG.md").read_text().split())
    missing = [p for p in added if p not in docs]
    assert not missing, "README.md paragraphs not yet in docs/:\n\n" + "\n\n".join(missing)


def test_readme_is_at_most_200_lines():
    # README.new.md replaces README.md when the branches' README paragraphs have
    # been moved into docs/; until then it is the one to check.
    readme = ROOT / "README.new.md"
    if not readme.exists():
        readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 200, f"{readme.name}: {len(text.splitlines())} lines"
    for needed in ("./dev demo", "./dev test", "./dev docs", "from agent_inbox import App"):
        assert needed in text, f"{readme.name} lacks {needed!r}"


def _commands(parser, path):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield [*path, name], sub
                yield from _commands(sub, [*path, name])


def test_cli_reference_has_every_command_and_option(monkeypatch):
    monkeypatch.setenv("AGENT_INBOX_LEASE_TTL", "7")  # the page shows the code's defaults
    page = _load("gen_cli").render()
    from agent_inbox.cli import build_parser

    headings = _headings(page)
    commands = list(_commands(build_parser(), ["agent-inbox"]))
    assert len(commands) > 30
    for path, parser in commands:
        assert " ".join(path) in headings
        for action in parser._actions:
            if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings:
                    assert f"`{flag}" in page, f"{' '.join(path)} {flag}"
    assert "| `--lease-ttl LEASE_TTL` |" in page and "| `120` |" in page
    assert os.environ["AGENT_INBOX_LEASE_TTL"] == "7"


def test_benchmark_page_has_every_result_file():
    results = ROOT / "bench" / "results"
    page = _load("gen_bench").render(results)
    headings = _headings(page)
    for path in results.glob("*.json"):
        assert path.name in headings
    assert "No figure this page knows how to show" not in page


def test_benchmark_page_tolerates_any_json(tmp_path):
    (tmp_path / "odd.json").write_text('{"a": {"b": [1, 2]}, "c": "x"}')
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "empty.json").write_text("{}")
    page = _load("gen_bench").render(tmp_path)
    for name in ("odd.json", "list.json", "broken.json", "empty.json"):
        assert f"## {name}" in page
    assert "| c | x |" in page and "Not readable as JSON" in page


def test_changelog_keeps_a_changelog_form():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    releases = _headings(text, "2")
    assert releases[0] == "[Unreleased]"
    for release in releases[1:]:
        assert re.fullmatch(r"(\[\d+\.\d+\.\d+\] - )?\d{4}-\d{2}-\d{2}", release), release
    kinds = set(_headings(text, "3"))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds


def test_docs_build_in_strict_mode(tmp_path):
    """`mkdocs build --strict`, as CI runs it: a broken link, a missing anchor, a
    page outside the nav or a reference mkdocstrings cannot resolve fails it."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed "
                                        "(pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material (the docs extra) is not installed")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings (the docs extra) is not installed")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "WARNING" not in output, output
    for page in ("index.html", "reference/cli.html", "reference/api.html",
                 "benchmarks/results.html", "benchmarks/method.html", "changelog.html",
                 "operating/console.html", "console-overview.png"):
        assert (tmp_path / "site" / page).exists(), page
    api = (tmp_path / "site" / "reference" / "api.html").read_text()
    for name in ("claim_batch", "step_key", "ApprovalNeeded", "run_agent", "StepRefused"):
        assert name in api, name
