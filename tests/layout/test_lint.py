"""The package's source passes ruff (pyproject.toml's [tool.ruff]: pyflakes'
undefined names, unused imports and redefinitions, and syntax errors): a move
that leaves a name behind fails here, before any test imports it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_source_passes_ruff():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    done = subprocess.run([ruff, "check", "--no-cache", "src", "migrations"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_store_passes_mypy_strict():
    """The SQL layer's and the run path's signatures are checked ([tool.mypy]
    in pyproject.toml: store/ and backend/ under strict): a statement function
    that returns the wrong shape, a caller that passes the wrong one, or a
    run path that strays from backend/path.py's RunPath, fails here."""
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    if mypy is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]' brings it)")
    done = subprocess.run([mypy, "--no-incremental"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
