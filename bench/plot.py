"""Draw bench/results/w1_scaling.png from bench/results/scaling.json.

    .venv/bin/python -m bench.plot [scaling.json] [out.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def draw(src: Path, dst: Path) -> Path:
    doc = json.loads(Path(src).read_text())
    counts = doc["counts"]
    names = doc.get("names", {"ours": "agent-inbox", "peer": "procrastinate"})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    panels = (("events_per_s_drain", "events/s, first handler start -> all done"),
              ("events_per_s", "events/s, worker spawn -> all done"))
    for ax, (key, title) in zip(axes, panels):
        for system, style in (("ours", "o-"), ("peer", "s--")):
            xs, ys, lo, hi = [], [], [], []
            for n in counts:
                s = doc["points"][system][str(n)][key]
                if s["median"] is None:
                    continue
                xs.append(n)
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=names[system])
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(n) for n in counts])
        ax.set_xlabel("worker processes (concurrency 1 each)")
        ax.set_ylabel("events/s")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    w = doc["workload"]
    m = doc["machine"]
    fig.suptitle(f"W1: {w['users']} users x {w['per_user']} events, no-op handler "
                 f"(median of {doc['reps']}; nproc {m['nproc']}, {m['postgresql'].split(' (')[0]})",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)
    plt.close(fig)
    return dst


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "scaling.json"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS / "w1_scaling.png"
    print(draw(src, dst))
