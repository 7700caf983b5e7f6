"""Greedy accuracy of the untrained embedded model (default Duo prompts) per arithmetic level.

Usage: python experiments/calibrate_arithmetic.py [--levels 1 2 3 4 5] [--problems 64] [PRESET overrides...]
Prints one JSON line per level and a Markdown table (recorded in docs/tasks.md). ``accuracy``
is what a run reports: the team's (its answering agent's answer), or for independent agents
(``rollout.mode=parallel``) the mean of the per-agent accuracies; ``team_accuracy`` is the
team verdict (independent agents: all correct).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time

import jax

from marft_jax.config import load_config
from marft_jax.rl.state import init_train_state
from marft_jax.train.build import build_run
from marft_jax.train.evaluate import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("config", nargs="*", default=["demo"])
    args = ap.parse_args()
    preset = [c for c in args.config if "=" not in c][:1] or ["demo"]
    overrides = [c for c in args.config if "=" in c]
    rows = []
    for level in args.levels:
        cfg = load_config(preset[0], overrides + [f"task.level={level}", "train.scoring_workers=0"])
        run = build_run(cfg)
        state = init_train_state(jax.random.key(0), run.model.cfg, cfg.lora, cfg.team.num_agents,
                                 cfg.optim)
        problems = list(itertools.islice(run.task.problems("test", 0), args.problems))
        t0 = time.perf_counter()
        res = evaluate(run.learner, state, problems, temperature=0.0, seeds=[0], batch_size=args.batch)
        summary = res.summary()
        row = {"level": level, "problems": len(problems), "accuracy": res.mean,
               "team_accuracy": summary["team_mean"], "independent": res.independent,
               "per_agent": summary["per_agent_mean"], "seconds": round(time.perf_counter() - t0, 1),
               "model": cfg.model.name, "profile": cfg.team.profile,
               "max_new_tokens": cfg.rollout.max_new_tokens, "machine": platform.processor() or platform.machine()}
        print(json.dumps(row), flush=True)
        rows.append(row)
        run.close()
    print("\n| level | accuracy (greedy) | team verdict | " + " | ".join(rows[0]["per_agent"]) + " |")
    print("|---|---|---|" + "---|" * len(rows[0]["per_agent"]))
    for r in rows:
        print(f"| {r['level']} | {100 * r['accuracy']:.1f}% | {100 * r['team_accuracy']:.1f}% | "
              + " | ".join(f"{100 * v:.1f}%" for v in r["per_agent"].values()) + " |")


if __name__ == "__main__":
    main()
