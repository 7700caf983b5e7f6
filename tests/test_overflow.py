"""``rollout.overflow``: episodes whose contexts outgrow ``rollout.context_window``.

A fake sampler and a character tokenizer play the policies exactly (no model); one tiny-model
run (a Trio MARFT-T team, three steps per episode, a window its contexts outgrow every
episode) shows a learning run finishing with the default policy.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from marft_jax.config import ConfigError, RolloutConfig, load_config
from marft_jax.envs.task import Problem, Score
from marft_jax.rl import backups, layout, packing
from marft_jax.rl.rollout import Generation, Team, min_budget, rollout
from tests.char_tokenizer import CharTokenizer

K = 8                       # every agent's budget; the fake sampler always fills it
ROLES = ("planner", "solver")


class RecordingSampler:
    """Agent ``a`` of row ``r`` answers ``c{call}a{a}r{r}`` padded to K characters (so a
    prompt shows which call's outputs it holds); records every prompt it gets."""

    def __init__(self):
        self.calls = 0
        self.prompts: list[tuple[int, list[int]]] = []   # (call, prompt) in order

    def __call__(self, prompts, agents, max_new, key):
        tok = CharTokenizer()
        n = len(prompts)
        tokens = np.zeros((n, K), np.int32)
        for j, p in enumerate(prompts):
            self.prompts.append((self.calls, list(p)))
            tokens[j] = tok.encode_text(f"c{self.calls}a{int(agents[j])}r{j}".ljust(K, "."))
        self.calls += 1
        logp = -np.ones((n, K), np.float32)
        return Generation(tokens, np.full(n, K, np.int32), logp, logp.copy(), np.zeros_like(logp))


def never_right(transcripts):
    return [Score(0.0, {}) for _ in transcripts]


PROBLEMS = [Problem(uid=f"p{b}", text=f"task {b}") for b in range(2)]
TEAM = Team(roles=ROLES, system_prompts=tuple(f"you are {r}" for r in ROLES), answer_agent=1)


def _play(window: int, overflow: str = "truncate_history", horizon: int = 3, problems=PROBLEMS):
    cfg = RolloutConfig(max_new_tokens=K, context_window=window, horizon=horizon, overflow=overflow)
    gen = RecordingSampler()
    traj, texts = rollout(problems, team=TEAM, tokenizer=CharTokenizer(), generate=gen, score=never_right,
                          cfg=cfg, key=jax.random.key(0))
    return traj, texts, gen, cfg


def _full_lengths() -> np.ndarray:
    """Each (step, agent)'s context length of row 0 when nothing is dropped ``[3, 2]``."""
    traj, _, _, _ = _play(4096)
    return np.asarray(traj.ctx_valid)[:, 0].sum(-1)


def _stored(traj, s, b, a) -> list[int]:
    return np.asarray(traj.ctx_tokens)[s, b, a][np.asarray(traj.ctx_valid)[s, b, a]].tolist()


def test_truncate_history_keeps_system_and_task_and_trains_on_the_prompt_the_sampler_saw():
    full = _full_lengths()
    window = int(full[2, 0]) + K            # step 2's planner has its full budget, its solver overflows
    assert full[2, 1] + min_budget(RolloutConfig(max_new_tokens=K), 1) > window
    traj, texts, gen, cfg = _play(window)
    assert np.asarray(traj.step_mask).all() and np.asarray(traj.terminal)[2].all()     # every step played
    assert texts.overflow_truncated == len(PROBLEMS)          # the step-2 solver prompts, once per row
    # every sampled prompt leaves the minimum budget, and what is stored is what was sampled
    sampled = iter(gen.prompts)
    act, av = np.asarray(traj.act_tokens), np.asarray(traj.act_valid)
    for s in range(3):
        for a in range(2):
            for b in range(len(PROBLEMS)):
                _, p = next(sampled)
                assert len(p) + min_budget(cfg, a) <= window
                assert _stored(traj, s, b, a) == p
                # the packed passes' sequence of this response: exactly the prompt, then the action
                seq = packing.sequence(np.asarray(traj.ctx_tokens)[s, b, a], np.asarray(traj.ctx_valid)[s, b, a],
                                       act[s, b, a], av[s, b, a])
                assert seq.tolist() == p + act[s, b, a][av[s, b, a]].tolist()
    text = CharTokenizer().decode(_stored(traj, 2, 0, 1))
    assert text.startswith("<system>you are solver<user>task 0")      # system prompt and task kept
    assert "c0a0r0" not in text and "c1a1r0" not in text              # step 0 (calls 0, 1) dropped
    assert "c2a0r0" in text and "c3a1r0" in text and "c4a0r0" in text  # step 1 and the planner of step 2
    assert len(_stored(traj, 2, 0, 1)) < full[2, 1]


def test_a_task_too_long_for_the_window_names_the_key_and_the_row():
    long = [PROBLEMS[0], Problem(uid="long-one", text="x" * 300)]
    with pytest.raises(ValueError, match=r"rollout\.context_window=120: row 1 \(problem 'long-one'\), agent 0"):
        _play(120, problems=long)


def test_end_episode_truncates_and_bootstraps_from_the_value():
    full = _full_lengths()
    window = int(full[2, 0]) + K                 # step 2's planner fits, its solver does not
    traj, texts, gen, _ = _play(window, "end_episode")
    step_mask, terminal, truncated = (np.asarray(x) for x in (traj.step_mask, traj.terminal, traj.truncated))
    np.testing.assert_array_equal(step_mask, [[True, True], [True, True], [False, False]])
    assert not terminal.any() and truncated[1].all() and not truncated[[0, 2]].any()
    assert texts.overflow_ended == 2 and texts.overflow_truncated == 0
    # what the planner sampled at step 2 is discarded; its step-2 prompt is the bootstrap state
    assert not np.asarray(traj.ctx_valid)[2].any() and not np.asarray(traj.act_valid)[2].any()
    step2_planner = [p for call, p in gen.prompts if call == 4]
    boot = np.asarray(traj.boot_ctx_tokens)[:, 0][np.asarray(traj.boot_ctx_valid)[:, 0]].reshape(2, -1)
    assert boot.tolist() == step2_planner
    # the backup bootstraps: zero rewards and values, V_boot = 1 gives the last agent gamma, not 0
    dp = layout.action_decision_mask(traj.act_valid, traj.step_mask)
    zeros = np.zeros(dp.shape, np.float32)
    adv, _ = backups.marft_gae(zeros, zeros, dp, traj.step_mask, traj.terminal, traj.truncated,
                               np.ones(2, np.float32), gamma=0.9, lam=1.0, impl="scan")
    np.testing.assert_allclose(np.asarray(adv)[1, :, 1], [0.9, 0.9], rtol=1e-6)


def test_error_names_the_key_the_row_and_the_lengths():
    full = _full_lengths()
    window = int(full[2, 0]) + K
    with pytest.raises(ValueError, match=rf"rollout\.overflow=error: row 0 \(problem 'p0'\), agent 1 \(solver\), "
                                         rf"step 2: the prompt has {full[2, 1]} tokens.*context_window={window}"):
        _play(window, "error")
    with pytest.raises(ConfigError, match="rollout.overflow"):
        load_config(None, ["rollout.overflow=drop"])


def test_a_trio_marft_t_run_whose_contexts_overflow_every_episode_finishes(tiny_model_dir, tmp_path, capsys):
    """The paper's Trio MARFT-T shape (3 steps, 512 new tokens, a 2048 window) scaled down: 32
    new tokens in a 192 window; the tiny random model fills its budget, so the second step's
    contexts outgrow the window in every episode."""
    from marft_jax.train.trainer import train
    from tests.tiny_run import tiny_overrides

    over = {"team.profile": "math/trio-short", "team.num_agents": 3, "algo.level": "token",
            "rollout.horizon": 3, "rollout.max_new_tokens": 32, "rollout.context_window": 192,
            "train.iterations": 2, "train.save_every": 0, "train.eval_before": "false", "train.eval_problems": 1,
            "model.decode_attention": "xla", "model.decode_matmul": "xla",
            "model.causal_attention": "xla"}
    out = train(load_config("demo", tiny_overrides(tiny_model_dir, tmp_path, "trio", **over)))
    assert out["iterations"] == 2 and "accuracy_after" in out
    # every prompt of steps 1 and 2 (2 rows x 3 agents x 2 steps) dropped turns in iteration 1
    assert ("iteration 1: contexts outgrew rollout.context_window=192: 12 prompt(s) dropped their oldest turns"
            in capsys.readouterr().out)
    steps = [json.loads(line) for line in (tmp_path / "trio" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "episode/steps_mean" in m] == [1, 2]
    assert all(m["episode/steps_mean"] == 3.0 for m in steps if "episode/steps_mean" in m)
