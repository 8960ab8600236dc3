"""The package's layers, read from the source: every import of every module of
src/agent_inbox (function-level and TYPE_CHECKING imports included) goes to a
layer below its own, or within its own package; services reach the database
only through api/; no import circle; at most MAX_TOP_MODULES modules at the
top of the package. docs/internals.md's "Layout" states the same table.
"""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "agent_inbox"

# A unit is a subpackage, or a group of top-level modules; its layer, lowest first.
UNIT_OF_TOP_MODULE = {
    "errors": "vocabulary", "records": "vocabulary", "validate": "vocabulary",
    "cron": "vocabulary", "tracing": "vocabulary", "tables": "vocabulary",
    "channels": "vocabulary", "notify": "vocabulary",
    "db": "connections", "metrics": "connections",
    "testing": "plugin", "__init__": "plugin",
}
LAYER = {
    "vocabulary": 0,   # stdlib only (and optional OpenTelemetry): names, rows, checks
    "connections": 1,  # psycopg pools, error translation, metrics
    "store": 2,        # the SQL, one module per table
    "agent": 3,        # what a handler sees and returns
    "backend": 3,      # how the run path's transactions are cut: plain, Citus
    "schema": 4,       # tables, migrations, revision checks
    "api": 4,          # the Inbox and the services' protocol
    "services": 5,     # worker, scheduler, dispatcher, intake, console
    "dev": 6,          # throwaway clusters, the demo, the examples' helpers
    "cli": 7,          # the command line
    "plugin": 8,       # the pytest plugin and the package's curated names
}
# Services go through the API: these units are not theirs to import.
SERVICES_MAY_NOT_IMPORT = ("store", "backend")
MAX_TOP_MODULES = 12


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def modules(src: Path) -> dict[str, Path]:
    return {module_name(path, src): path for path in sorted(src.rglob("*.py"))
            if "migrations" not in path.relative_to(src).parts}


def unit(module: str) -> str:
    first = module.split(".")[0]
    return UNIT_OF_TOP_MODULE.get(first, first) if "." not in module else first


def imports(src: Path) -> dict[str, set[str]]:
    """Each module's imports of the package's own modules (its name relative
    to agent_inbox: 'api.inbox'); an import of a package's name counts as one
    of the package."""
    known = modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():  # (name "__init__" is the package itself)
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = ["agent_inbox", *name.split(".")] if name != "__init__" else ["agent_inbox"]
                    here = here if is_package else here[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                # `from P import m`: the module P.m where there is one, else a name of P
                targets = [f"{base}.{alias.name}"
                           if f"{base}.{alias.name}".removeprefix("agent_inbox.") in known
                           else base for alias in node.names]
            for target in targets:
                if not target.startswith("agent_inbox."):
                    continue
                relative = target.removeprefix("agent_inbox.")
                while relative and relative not in known:
                    relative = relative.rpartition(".")[0]
                if relative and relative != name:
                    found.add(relative)
        graph[name] = found
    return graph


def violations(src: Path) -> list[str]:
    """Imports that break the layers, as 'importer -> imported (why)'."""
    found = []
    for importer, targets in imports(src).items():
        mine = unit(importer)
        for target in sorted(targets):
            theirs = unit(target)
            if mine == theirs:
                continue
            if mine not in LAYER or theirs not in LAYER:
                found.append(f"{importer} -> {target} (no layer for {mine if mine not in LAYER else theirs})")
            elif LAYER[theirs] > LAYER[mine]:
                found.append(f"{importer} -> {target} (layer {LAYER[theirs]} above {LAYER[mine]})")
            elif LAYER[theirs] == LAYER[mine]:
                found.append(f"{importer} -> {target} (two units of layer {LAYER[mine]})")
            elif mine == "services" and theirs in SERVICES_MAY_NOT_IMPORT:
                found.append(f"{importer} -> {target} (services go through api/)")
    return found


def circles(src: Path) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module."""
    graph = imports(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_import_goes_down_the_layers():
    assert violations(SRC) == []


def test_no_import_circle():
    assert circles(SRC) == []


def test_the_top_of_the_package_is_small():
    top = sorted(path.name for path in SRC.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    assert {path.stem for path in SRC.glob("*.py")} <= set(UNIT_OF_TOP_MODULE)


def test_every_package_ships_and_has_a_layer():
    packages = {module_name(path, SRC) for path in SRC.rglob("__init__.py")} - {"__init__"}
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {f"agent_inbox.{name}" for name in packages} | {"agent_inbox"} <= set(declared)
    assert {name.split(".")[0] for name in packages} <= set(LAYER)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "agent_inbox"
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


def test_the_check_sees_an_import_of_a_layer_above(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "", "errors.py": "", "store/__init__.py": "",
        "store/lease.py": "from agent_inbox import errors\n"
                          "def late():\n    from agent_inbox.api import inbox\n",
        "api/__init__.py": "", "api/inbox.py": "from agent_inbox.store import lease\n",
        "services/__init__.py": "", "services/dispatcher.py": "from agent_inbox.store import lease\n",
    })
    assert violations(src) == ["services.dispatcher -> store.lease (services go through api/)",
                               "store.lease -> api.inbox (layer 4 above 2)"]
    assert circles(src) == [["api.inbox", "store.lease"]]


@pytest.mark.parametrize("text", ["from . import inbox\n", "from .inbox import Inbox\n"])
def test_the_check_reads_relative_imports(tmp_path, text):
    src = _tree(tmp_path, {"__init__.py": "", "api/__init__.py": "", "api/inbox.py": "",
                           "store/__init__.py": "", "store/inbox.py": "",
                           "store/lease.py": text.replace(". import", "..api import")
                           .replace(".inbox", "..api.inbox")})
    assert violations(src) == ["store.lease -> api.inbox (layer 4 above 2)"]


def test_the_documented_layout_names_every_module():
    """docs/internals.md's Layout block names each package and each module of
    the tree (a module of a package by its file name, on its package's line or
    after it), so the page cannot drift from the tree."""
    page = (ROOT / "docs" / "internals.md").read_text()
    block = page[page.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC)
        if relative.name == "__init__.py" or "migrations" in relative.parts:
            if relative.name == "__init__.py" and len(relative.parts) > 1 \
                    and f"{relative.parts[-2]}/" not in block:
                missing.append(str(relative.parent) + "/")
            continue
        if path.stem not in block:
            missing.append(str(relative))
    assert missing == []
