"""The contract suite (tests/contract) has no twins: a test function of it is
collected there alone, once per backend by its conftest, never imported into
another test module (tests/citus, tests/behind_pgbouncer or any other) to be
collected again under that folder's fixtures, as import lists once did.
Helpers (race_behind, run_with, ...) may be imported; `test*` names and `*` may not.
What cannot hold on a backend is left out there by skip_backend, which always
names known backends and a reason.
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _imported_from(node: ast.ImportFrom, path: Path, tests: Path) -> str:
    if not node.level:
        return node.module or ""
    package = ["tests", *path.relative_to(tests).parent.parts]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def contract_tests_imported_elsewhere(tests: Path = TESTS) -> list[str]:
    found = []
    for path in sorted(tests.rglob("*.py")):
        if tests / "contract" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = _imported_from(node, path, tests)
                if module != "tests.contract" and not module.startswith("tests.contract."):
                    continue
                names = [alias.name for alias in node.names
                         if alias.name == "*" or alias.name.startswith("test")]
                if names:
                    found.append(f"{path.relative_to(tests.parent)}:{node.lineno} imports "
                                 f"{', '.join(names)} from {module}")
    return found


def test_no_test_module_imports_the_contract_suites_tests():
    assert contract_tests_imported_elsewhere() == [], (
        "a contract test runs on every backend from tests/contract alone: mark what cannot "
        "hold on a backend with @pytest.mark.skip_backend(name, reason=...) instead of a twin")


def test_the_check_sees_an_import_list(tmp_path):
    tests = tmp_path / "tests"
    (tests / "contract").mkdir(parents=True)
    (tests / "contract" / "test_steps.py").write_text("def test_a_thing(): pass\n")
    (tests / "citus").mkdir()
    (tests / "citus" / "test_steps.py").write_text(
        "from tests.contract.test_steps import (test_a_thing,  # noqa\n"
        "    race_behind)\n"
        "from ..contract.test_memory import *  # noqa\n"
        "from tests.contract.test_concurrency import race_behind  # noqa\n"
        "from tests.test_operator_cli import test_x  # noqa\n")
    assert contract_tests_imported_elsewhere(tests) == [
        "tests/citus/test_steps.py:1 imports test_a_thing from tests.contract.test_steps",
        "tests/citus/test_steps.py:3 imports * from tests.contract.test_memory",
    ]


class _Node:
    def __init__(self, *marks):
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name):
        return (m for m in self.marks if m.name == name)


def test_skip_backend_skips_with_its_reason_and_refuses_typos_and_silence():
    from tests.contract.conftest import _skip_reason

    node = _Node(pytest.mark.skip_backend("citus", "pgbouncer", reason="why"))
    assert _skip_reason(node, "citus") == _skip_reason(node, "pgbouncer") == "why"
    assert _skip_reason(node, "plain") is None
    assert _skip_reason(_Node(), "citus") is None
    for silent in (pytest.mark.skip_backend("citus"), pytest.mark.skip_backend("citus", reason=""),
                   pytest.mark.skip_backend("cittus", reason="why"),
                   pytest.mark.skip_backend(reason="why")):
        with pytest.raises(pytest.fail.Exception):
            _skip_reason(_Node(silent), "plain")


# --- the run path is chosen once (backend/path.py) --------------------------------

SRC = TESTS.parent / "src" / "agent_inbox"
# Where the choice is made: Inbox.connect detects a coordinator, backend/path.py's
# for_pool picks the implementation, backend/citus/ is the per-bucket side's own,
# and the command line's migrate --citus lays a database out.
CHOOSES = {"api/inbox.py", "backend/path.py", "cli/main.py"}


def branches_on_the_backend(src: Path = SRC) -> list[str]:
    """Reads of an `Inbox.citus` flag (`x.citus` used as a condition) outside
    the seam's construction."""
    found = []
    for path in sorted(src.rglob("*.py")):
        where = path.relative_to(src).as_posix()
        if where in CHOOSES or where.startswith("backend/citus/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            tests_ = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
            tests_ += node.values if isinstance(node, ast.BoolOp) else []
            for test in tests_:
                for part in ast.walk(test):
                    if isinstance(part, ast.Attribute) and part.attr == "citus":
                        found.append(f"{path.relative_to(src.parent)}:{part.lineno}")
    return found


def test_nothing_outside_the_seam_branches_on_citus():
    assert branches_on_the_backend() == []


def test_the_backend_check_sees_a_branch(tmp_path):
    (tmp_path / "runs.py").write_text("def f(self):\n    if self.citus:\n        return 1\n"
                                      "    return 2 if self.inbox.citus else 3\n")
    assert branches_on_the_backend(tmp_path) == [f"{tmp_path.name}/runs.py:2",
                                                 f"{tmp_path.name}/runs.py:4"]
