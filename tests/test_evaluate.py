"""Evaluation grades against ``rollout.success_threshold`` (a fake learner: no model involved)."""

import types

import numpy as np
import pytest

from marft_jax.envs.task import Problem, Score
from marft_jax.config import RolloutConfig
from marft_jax.rl.rollout import Team
from marft_jax.train.evaluate import evaluate

ROLES = ("planner", "solver")


class FakeLearner:
    """Plays 3 problems for 2 steps; problem b's episode ends at step ``last[b]`` with score
    ``final[b]``; every agent's own output is graded ``agent_reward[role]``."""

    def __init__(self, threshold: float, mode: str = "sequential"):
        self.team = Team(roles=ROLES, system_prompts=("plan", "solve"), answer_agent=1)
        self.rollout_cfg = RolloutConfig(success_threshold=threshold, mode=mode)
        self.last = np.array([0, 1, 1])
        self.final = np.array([0.5, 0.8, 1.0], np.float32)
        self.agent_reward = {"planner": 0.6, "solver": 0.9}

    def play(self, state, chunk, key, *, sampling):
        assert sampling.temperature == 0.6 and len(chunk) == 3
        step_mask = np.array([[True, True, True], [False, True, True]])
        score = np.zeros((2, 3), np.float32)
        score[self.last, np.arange(3)] = self.final
        outputs = [[(f"s{s} p{b} planner", f"s{s} p{b} solver") for b in range(3)] for s in range(2)]
        infos = [[{} for _ in range(3)] for _ in range(2)]
        traj = types.SimpleNamespace(step_mask=step_mask, score=score)
        return traj, types.SimpleNamespace(outputs=outputs, infos=infos)

    def score_fn(self, transcripts):
        return [Score(reward=self.agent_reward[ROLES[t.answer_agent]]) for t in transcripts]


@pytest.mark.parametrize("threshold, team, correct, per_agent", [
    (0.7, 2 / 3, [False, True, True], {"planner": 0.0, "solver": 1.0}),
    (0.5, 1.0, [True, True, True], {"planner": 1.0, "solver": 1.0}),
    (1.0, 1 / 3, [False, False, True], {"planner": 0.0, "solver": 0.0}),
])
def test_team_agents_and_examples_use_the_success_threshold(threshold, team, correct, per_agent):
    learner = FakeLearner(threshold)
    problems = [Problem(uid=str(b), text=f"p{b}", answer="1") for b in range(3)]
    result = evaluate(learner, None, problems, temperature=0.6, seeds=[0, 1], keep_examples=3)
    assert result.team == pytest.approx([team, team])
    assert result.per_agent == {r: pytest.approx([v, v]) for r, v in per_agent.items()}
    assert [e["correct"] for e in result.examples] == correct
    assert [e["outputs"]["solver"] for e in result.examples] == ["s0 p0 solver", "s1 p1 solver", "s1 p2 solver"]
    assert not result.independent and result.accuracy == result.team and result.mean == pytest.approx(team)


def test_independent_agents_report_the_mean_of_their_accuracies():
    """Reference §10: independent PPO reports per-agent accuracies and their mean; the team
    verdict (all agents correct) stays in the file beside it."""
    learner = FakeLearner(0.7, mode="parallel")
    learner.agent_reward = {"planner": 0.6, "solver": 0.9}          # planner wrong, solver right
    problems = [Problem(uid=str(b), text=f"p{b}", answer="1") for b in range(3)]
    result = evaluate(learner, None, problems, temperature=0.6, seeds=[0, 1])
    assert result.independent
    assert result.accuracy == pytest.approx([0.5, 0.5]) and result.mean == pytest.approx(0.5)
    summary = result.summary()
    assert summary["accuracy_mean"] == pytest.approx(0.5)
    assert summary["team_mean"] == pytest.approx(2 / 3)           # the episodes' verdict, unchanged
