"""MkDocs hooks (mkdocs.yml `hooks:`): the pages made from the code and the
repository at every build, so none of them can drift.

- reference/cli.md        from agent_inbox.cli.build_parser() (docs/gen_cli.py)
- benchmarks/results.md   from bench/results/*.json (docs/gen_bench.py)
- benchmarks/method.md    bench/README.md, as it is
- changelog.md            CHANGELOG.md, as it is
- benchmarks/w1_scaling.png  bench/results/w1_scaling.png
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"agent_inbox_docs_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_readme() -> str:
    text = (ROOT / "bench" / "README.md").read_text()
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    head = ["# How the benchmarks are measured", "",
            "<!-- bench/README.md, included by docs/hooks.py at every build: edit that file. -->",
            "", "*This page is `bench/README.md`, as it is in the repository.*", ""]
    return "\n".join(head + lines) + "\n"


def _changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text()


def on_files(files: Files, config) -> Files:
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    generated = {
        "reference/cli.md": _load("gen_cli").render(),
        "benchmarks/results.md": _load("gen_bench").render(ROOT / "bench" / "results"),
        "benchmarks/method.md": _bench_readme(),
        "changelog.md": _changelog(),
    }
    for path, content in generated.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    plot = ROOT / "bench" / "results" / "w1_scaling.png"
    if plot.exists():
        files.append(File.generated(config, "benchmarks/w1_scaling.png", abs_src_path=str(plot)))
    return files
