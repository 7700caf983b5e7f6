"""Evaluation: the team (or the base model with team prompts) on held-out problems, N seeds.

Team accuracy = fraction of episodes whose answering agent's final answer is accepted; for
independent agents (every agent answers alone), whose agents' mean score reaches the success
threshold (all correct, at 0/1 scores). Per-agent accuracy grades every agent's own output of the
final step as if it answered (shows how far the chain carries the answer). The accuracy a run
reports (:attr:`EvalResult.mean`) is the team accuracy, or for independent agents the mean of the
per-agent accuracies (docs/algorithm.md#evaluation). Reported numbers: T = 0.6, 5 seeds, mean ±
population std of the per-seed accuracies.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from marft_jax.envs.task import Problem, Transcript
from marft_jax.rl import layout
from marft_jax.rl.state import TrainState
from marft_jax.train.hosts import ProcessRows
from marft_jax.train.iteration import TeamLearner


@dataclasses.dataclass
class EvalResult:
    """Per-seed accuracies (fractions in [0, 1]). ``independent``: every agent answers alone."""

    team: list[float]
    per_agent: dict[str, list[float]]
    examples: list[dict]
    independent: bool = False

    @property
    def accuracy(self) -> list[float]:
        """Per seed, what a run reports: ``team``, or for independent agents the mean over agents."""
        if not self.independent:
            return list(self.team)
        return [float(v) for v in np.mean([self.per_agent[r] for r in self.per_agent], axis=0)]

    @property
    def mean(self) -> float:
        return float(np.mean(self.accuracy))

    @property
    def std(self) -> float:
        return float(np.std(self.accuracy))  # population std, as G3's aggregator

    def summary(self) -> dict:
        """The eval file's numbers; ``team*`` is the team verdict (all correct for independent
        agents), ``accuracy*`` what the run reports."""
        return {"accuracy_mean": self.mean, "accuracy_std": self.std, "accuracy": self.accuracy,
                "team_mean": float(np.mean(self.team)), "team_std": float(np.std(self.team)), "team": self.team,
                "per_agent": dict(self.per_agent),
                "per_agent_mean": {k: float(np.mean(v)) for k, v in self.per_agent.items()}}


def evaluate(learner: TeamLearner, state: TrainState, problems: Sequence[Problem], *, temperature: float,
             seeds: Sequence[int], batch_size: int = 32, keep_examples: int = 3) -> EvalResult:
    """Play the team on ``problems`` once per seed and grade it.

    ``problems``: the whole evaluation set, the same on every process. With several processes
    each plays, decodes and grades its own block of every chunk (``learner.rows``); the
    per-agent grades and the examples are gathered, so every process returns the same result.
    """
    sampling = dataclasses.replace(learner.rollout_cfg, temperature=temperature, top_k=0, top_p=1.0)
    roles = learner.team.roles
    rows = getattr(learner, "rows", None) or ProcessRows()     # a learner-like object without rows: one process
    team, per_agent = [], {r: [] for r in roles}
    examples: list[dict] = []
    for seed in seeds:
        correct, agent_correct = [], {r: [] for r in roles}
        key = jax.random.key(seed)
        for start in range(0, len(problems), batch_size):
            chunk = list(problems[start:start + batch_size])
            lo, hi = rows.bounds(len(chunk))
            mine = chunk[lo:hi]
            key, k = jax.random.split(key)
            traj, texts = learner.play(state, mine, k, sampling=sampling)     # traj: the whole chunk
            step_mask = np.asarray(traj.step_mask)
            last = np.asarray(layout.last_played_step(step_mask))              # [B]
            final = np.asarray(traj.score)[last, np.arange(len(chunk))]
            passed = final >= learner.rollout_cfg.success_threshold
            correct += list(passed)
            outs = [tuple(texts.outputs[last[lo + b]][b]) for b in range(len(mine))]
            transcripts = [Transcript(p, o, i) for p, o in zip(mine, outs) for i in range(len(roles))]
            grades = [s.reward >= learner.rollout_cfg.success_threshold for s in learner.score_fn(transcripts)]
            mine_examples = []
            for b in range(min(keep_examples - len(examples), len(mine))):
                mine_examples.append({"problem": mine[b].text, "answer": mine[b].answer,
                                      "outputs": dict(zip(roles, outs[b])), "correct": bool(passed[lo + b]),
                                      "info": texts.infos[last[lo + b]][b]})
            parts = rows.gather((grades, mine_examples))       # one process: its own
            grades = [g for part in parts for g in part[0]]
            mine_examples = [e for part in parts for e in part[1]]
            for j, g in enumerate(grades):
                agent_correct[roles[j % len(roles)]].append(g)
            examples += mine_examples[:max(keep_examples - len(examples), 0)]
        team.append(float(np.mean(correct)))
        for r in roles:
            per_agent[r].append(float(np.mean(agent_correct[r])))
    return EvalResult(team=team, per_agent=per_agent, examples=examples,
                      independent=learner.team.graph(learner.rollout_cfg.mode).independent)
