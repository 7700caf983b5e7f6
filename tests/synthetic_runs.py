"""Synthetic run folders, laid out as the trainer writes them, for the table/plot/results tests
(no model, no training)."""

from __future__ import annotations

import json
from pathlib import Path


def _eval(path: Path, tag: str, method: str, agents: int, roles: str, acc: float, benchmark: str,
          per_agent: dict[str, float] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"tag": tag, "benchmark": benchmark, "problems": 128, "temperature": 0.0,
           "method": method, "agents": agents, "roles": roles, "seeds": [acc],
           "team_mean": acc, "team_std": 0.0, "team": [acc], "examples": []}
    if per_agent is not None:
        doc["per_agent"] = {r: [v] for r, v in per_agent.items()}
        doc["per_agent_mean"] = dict(per_agent)
    path.write_text(json.dumps(doc))


def make_run(root: Path, name: str, *, method: str, agents: int, roles: str = "named", seed: int = 0,
             before: float = 0.1, periodic: dict[int, float] | None = None, after: float | None = 0.2,
             iterations: int = 30, share_before: bool = False, rewards: list[float] | None = None,
             benchmark: str = "arithmetic", before_method: str = "untrained base (team prompts)",
             per_agent_before: dict[str, float] | None = None, per_agent_after: dict[str, float] | None = None,
             before_from: str = "elsewhere", mode: str | None = None) -> Path:
    """One run folder ``root/name``: config.yaml (train.seed, train.iterations), metrics.jsonl
    (``episode/score_mean`` per iteration), eval/before.json (unless ``share_before``: then the
    untrained accuracy is only in summary.json, as a sweep run that reuses another's, named by
    ``before_from``), eval/periodic/iter<N>.json, and with ``after`` eval/after.json +
    summary.json. The eval files are those of the trainer before they said ``independent``;
    ``per_agent_*``: their per-agent accuracies; ``mode``: ``rollout.mode`` in config.yaml."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  seed: {seed}\n  iterations: {iterations}\n"
                                     + (f"rollout:\n  mode: {mode}\n" if mode else ""))
    rewards = rewards if rewards is not None else [0.1 + 0.01 * i for i in range(iterations)]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "episode/score_mean": r}) + "\n" for i, r in enumerate(rewards)))
    if not share_before:
        _eval(run / "eval" / "before.json", "before", before_method, agents, roles, before, benchmark,
              per_agent_before)
    for it, acc in (periodic or {}).items():
        _eval(run / "eval" / "periodic" / f"iter{it:06d}.json", f"iter{it:06d}", method, agents, roles, acc, benchmark)
    if after is not None:
        _eval(run / "eval" / "after.json", "after", method, agents, roles, after, benchmark, per_agent_after)
        summary = {"run_dir": str(run), "iterations": iterations, "accuracy_before": before,
                   "accuracy_after": after, "wall_s": 100.0}
        if share_before:
            summary["accuracy_before_from"] = before_from
        (run / "summary.json").write_text(json.dumps(summary))
    return run
