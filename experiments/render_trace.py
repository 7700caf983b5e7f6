"""Render the stage annotations of a jax.profiler Perfetto trace as a timeline PNG.

    python experiments/render_trace.py TRACE_DIR_OR_FILE docs/figures/trace_cpu_iteration.png

Reads the ``*.trace.json.gz`` (gzipped Chrome trace JSON) that ``train.profile`` /
``--profile`` write, keeps the complete events (``ph == "X"``) whose names are the stage
annotations (``rollout``, ``rollout/step<s>/agents<i>``, ``sampler/...``, ``prepare``,
``update``), stacks nested events below their parents and draws one bar per event.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

STAGES = ("rollout", "sampler/", "prepare", "update")


def load_events(path: Path) -> list[dict]:
    if path.is_dir():
        path = sorted(path.rglob("*trace.json.gz"))[-1]
    doc = json.loads(gzip.open(path).read())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    keep = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(STAGES)]
    return sorted(keep, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))


def render(events: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(float(e["ts"]) for e in events)
    open_ends: list[float] = []        # end time of the open event at each depth
    rows = []
    for e in events:
        start, end = float(e["ts"]) - t0, float(e["ts"]) - t0 + float(e.get("dur", 0))
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        rows.append((len(open_ends), start / 1e6, (end - start) / 1e6, e["name"]))
        open_ends.append(end)
    colours = {"rollout": "tab:blue", "sampler/prefill": "tab:orange", "sampler/decode": "tab:green",
               "prepare": "tab:purple", "update": "tab:red"}
    depth = max(r[0] for r in rows) + 1
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * depth))
    for d, start, dur, name in rows:
        key = next((k for k in colours if name == k or name.startswith(k)), "rollout")
        ax.barh(-d, dur, left=start, height=0.8, color=colours.get(key, "tab:gray"), edgecolor="black", lw=0.3)
        if dur > 0.04 * max(r[1] + r[2] for r in rows):
            ax.text(start + dur / 2, -d, name, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks([-d for d in range(depth)], [f"depth {d}" for d in range(depth)])
    ax.set_xlabel("seconds from the start of the traced iteration")
    ax.set_title("jax.profiler trace, host stage annotations (CPU)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    events = load_events(args.trace)
    if not events:
        raise SystemExit(f"{args.trace}: no stage annotations found")
    render(events, args.out)
    print(f"{len(events)} events -> {args.out}")


if __name__ == "__main__":
    main()
