"""The benchmark results page, made from bench/results/*.json at every docs build
(docs/hooks.py), so the figures shown are the files' own.

The files come from several tools (bench.run, bench.ab, bench.ab_agents,
bench.w6, bench.w7, bench.console, ...) and differ in shape. Each gets a
section: the run's date and commit where it says them, then its main figures
in the form it has them (bench.run's `table` of medians with min-max and the
peer beside them; bench.w7's printed table; an A/B file's medians per
revision), else its top-level figures, else a list of its keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Keys that hold the setting or the raw repetitions, not a figure worth a row.
BULKY = {"machine", "config", "runs", "checks", "errors", "extra", "code", "source",
         "working_tree", "settings", "nodes", "top_statements", "poll_cpu_per_s",
         "setup", "reps", "extra_args", "commits", "revs", "counts", "names"}


def _number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 0.01 or value == 0:
            return f"{value:.3g}"
        return f"{value:.2e}"
    return str(value)


def _cell(value: Any) -> str:
    text = _number(value).replace("\n", " ")
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def _median_range(figure: Any) -> str:
    if isinstance(figure, dict) and "median" in figure:
        text = _number(figure["median"])
        if "min" in figure and "max" in figure and figure["min"] != figure["max"]:
            text += f" [{_number(figure['min'])}-{_number(figure['max'])}]"
        return text
    if figure is None:
        return ""
    return _number(figure)


def _provenance(data: dict) -> list[str]:
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    date = machine.get("date") or data.get("date")
    commit = None
    for holder in (machine.get("agent_inbox_code"), data.get("code"), data.get("source"),
                   data.get("working_tree")):
        if isinstance(holder, dict) and holder.get("git"):
            commit = holder["git"]
            break
    commit = commit or machine.get("agent_inbox_git") or data.get("commit") or data.get("rev")
    facts = []
    if date:
        facts.append(f"run {date}")
    if commit:
        facts.append(f"agent-inbox at `{str(commit)[:12]}`")
    if machine.get("nproc"):
        facts.append(f"{machine['nproc']} cores")
    if data.get("command"):
        facts.append(f"`{data['command'].strip()}`")
    correct = data.get("correct", data.get("all_exactly_once"))
    if correct is not None:
        facts.append("correctness checks passed" if correct else "**a correctness check failed**")
    return ["; ".join(facts) + ".", ""] if facts else []


def _run_table(rows: list[dict]) -> list[str]:
    """bench.run's `table`: one row per figure, ours beside the peer and the ceiling."""
    has_peer = any(row.get("peer") for row in rows)
    has_ceiling = any(row.get("ours_over_ceiling") is not None for row in rows)
    head = ["workload", "figure", "unit", "agent-inbox, median [min-max]"]
    if has_peer:
        head += ["peer", "ours / peer"]
    if has_ceiling:
        head += ["ours / ceiling"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.get("workload", ""), row.get("figure", ""), row.get("unit", ""),
                 _median_range(row.get("ours"))]
        if has_peer:
            cells += [_median_range(row.get("peer")), _median_range(row.get("ours_over_peer"))]
        if has_ceiling:
            cells += [_median_range(row.get("ours_over_ceiling"))]
        lines.append("| " + " | ".join(_cell(c) if not isinstance(c, str) or c else "" for c in cells) + " |")
    return lines + [""]


def _flatten(value: Any, prefix: str = "", depth: int = 2) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and depth > 0:
        out = []
        for key, inner in value.items():
            out += _flatten(inner, f"{prefix}.{key}" if prefix else str(key), depth - 1)
        return out
    if isinstance(value, (int, float, str, bool)) or value is None:
        return [(prefix, value)]
    return []


def _medians_only(value: Any) -> Any:
    """A {median, min, max, runs} figure as its median, anywhere inside `value`."""
    if isinstance(value, dict):
        if "median" in value and not isinstance(value["median"], dict):
            return value["median"]
        return {key: _medians_only(inner) for key, inner in value.items()}
    return value


def _records_table(records: list) -> list[str]:
    """A list of records (one per repetition or revision): one row each."""
    rows = [dict(_flatten(_medians_only(r))) for r in records if isinstance(r, dict)]
    keys = [k for k in dict.fromkeys(k for row in rows for k in row)]
    if not rows or not keys or len(keys) > 12:
        return []
    lines = ["| " + " | ".join(_cell(k) for k in keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines + [""]


def _columns_table(columns: dict) -> list[str]:
    """{column: {figure: value}} (an A/B file's medians): figures down, columns across."""
    names = list(columns)
    figures: dict[str, dict[str, Any]] = {}
    for name in names:
        for figure, value in _flatten(columns[name]):
            figures.setdefault(figure, {})[name] = value
    if not figures:
        return []
    lines = ["| figure | " + " | ".join(_cell(n) for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for figure, values in figures.items():
        lines.append(f"| {_cell(figure)} | " + " | ".join(_cell(values.get(n, "")) for n in names) + " |")
    return lines + [""]


def _medians(medians: dict) -> list[str]:
    # Either {rev: {figure: v}} or {workload: {rev: {figure: v}}}.
    nested = all(isinstance(v, dict) and all(isinstance(w, dict) for w in v.values())
                 for v in medians.values())
    if not nested:
        return _columns_table(medians)
    lines = []
    for workload, columns in medians.items():
        lines += [f"*{workload}*", ""] + _columns_table(columns)
    return lines


def _figures(data: dict) -> list[str]:
    pairs = [(key, value) for key, value in _flatten({k: v for k, v in data.items()
                                                       if k not in BULKY})
             if key not in ("date", "command", "correct", "all_exactly_once", "rev", "commit",
                            "what", "quick")]
    pairs = [(k, v) for k, v in pairs if not (isinstance(v, str) and len(v) > 200)]
    if not pairs:
        return []
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {_cell(key)} | {_cell(value)} |" for key, value in pairs]
    return lines + [""]


def section(path: Path) -> list[str]:
    lines = [f"## {path.name}", ""]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return lines + [f"Not readable as JSON: {error}.", ""]
    if not isinstance(data, dict):
        return lines + [f"A JSON {type(data).__name__} of {len(data)} items." if isinstance(data, list)
                        else f"`{_cell(data)}`", ""]
    lines += _provenance(data)
    if isinstance(data.get("what"), str):
        lines += [data["what"].rstrip(".") + ".", ""]
    body: list[str] = []
    table = data.get("table")
    if isinstance(table, list) and table and all(isinstance(r, dict) for r in table):
        body = _run_table(table)
    elif isinstance(table, list) and table and all(isinstance(r, str) for r in table):
        body = ["```text", *table, "```", ""]
    for key in ("medians", "median", "summary", "ratio_working_tree_over_rev",
                "ratio_over_a014c1a", "pages", "median_events_per_s"):
        if isinstance(data.get(key), dict) and data[key]:
            if key == "pages":
                body += ["Per page:", ""] + _columns_table(
                    {"median ms": {p: v.get("median_ms") for p, v in data[key].items()},
                     "p95 ms": {p: v.get("p95_ms") for p, v in data[key].items()},
                     "max ms": {p: v.get("max_ms") for p, v in data[key].items()}})
            elif key.startswith("ratio"):
                body += [f"Ratios (`{key}`):", ""] + _medians(data[key])
            elif key in ("median", "median_events_per_s"):
                body += _columns_table({key: data[key]})
            else:
                body += _medians(data[key])
    if isinstance(data.get("points"), dict):  # bench.run --scaling: per system, per process count
        for system, points in data["points"].items():
            body += [f"*{system}*, by worker processes:", ""] + _columns_table(
                {count: _medians_only(figures) for count, figures in points.items()})
    if not table:
        body = _figures(data) + body
    if not body and isinstance(data.get("runs"), list):
        body = _records_table(data["runs"])
    if not body:
        keys = ", ".join(f"`{k}`" for k in data)
        body = [f"No figure this page knows how to show; its keys: {keys}.", ""]
    return lines + body


def render(results: Path) -> str:
    files = sorted(results.glob("*.json"))
    lines = [
        "# Benchmark results",
        "",
        "<!-- Generated from bench/results/*.json by docs/gen_bench.py at every build: "
        "do not edit. -->",
        "",
        f"Every JSON file under `bench/results/` ({len(files)} files), as it was "
        "committed with the run that made it; generated at every docs build, so the "
        "figures are the files' own. The [benchmarks page](index.md) says which "
        "figures answer which question, and [how they are measured](method.md) how "
        "each workload is run. Times are seconds unless a unit says otherwise; "
        "a range in brackets is the min-max over the repetitions.",
        "",
    ]
    if (results / "w1_scaling.png").exists():
        lines += ["![W1 at 1, 2, 4 and 8 worker processes (bench/results/w1_scaling.png)]"
                  "(w1_scaling.png)", ""]
    for path in files:
        lines += section(path)
    others = sorted(p.name for p in results.iterdir() if p.suffix not in (".json", ".png"))
    if others:
        lines += ["## Other files", "",
                  "Plans (EXPLAIN ANALYZE) and printed summaries, in `bench/results/`: "
                  + ", ".join(f"`{name}`" for name in others) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    import sys

    print(render(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")), end="")
