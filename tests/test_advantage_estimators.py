"""The advantage-estimator seam (``algo.advantage``, :mod:`marft_jax.rl.advantages`).

* ``group`` (critic-free): the group baseline by hand, its credit along the chain at the action
  and token levels, and the independent graph's per-agent groups.
* A critic-free run has no critic: none in the state, no feature pass, no critic update, and its
  checkpoint round-trips.
* A third estimator is one function and its registration, here in this file alone: a REINFORCE
  with a batch-mean baseline trains one iteration.
* ``group`` learns the relay of ``tests/test_learning.py`` (the team from chance to >= 0.9).
* Bad keys name themselves.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.config import AlgoConfig, ConfigError, LoraConfig, OptimConfig, PPOConfig, RolloutConfig, load_config
from marft_jax.rl import advantages, backups
from marft_jax.rl.advantages import AdvantageConfig, AdvantageInputs, Advantages
from marft_jax.rl.rollout import Team
from marft_jax.rl.state import init_train_state
from marft_jax.rl.update import UpdateConfig
from marft_jax.sampling.sampler import Sampler
from marft_jax.train.iteration import TeamLearner
from tests.toy_relay import RelayTask, ToyChatTokenizer, model_config

S, B, N, K = 2, 8, 2, 3


def _inputs(score_last: np.ndarray, *, steps_played: np.ndarray | None = None) -> AdvantageInputs:
    """Rows ``B``, each played ``steps_played[b]`` steps (default all ``S``), its final score
    ``score_last[b]``, every agent with ``K`` valid tokens."""
    played = np.full(B, S) if steps_played is None else steps_played
    step_mask = np.arange(S)[:, None] < played[None, :]                      # [S, B]
    last = np.arange(S)[:, None] == played[None, :] - 1
    score = np.where(last, score_last[None, :], 0.0).astype(np.float32)
    act_valid = np.broadcast_to(step_mask[:, :, None, None], (S, B, N, K)).copy()
    return AdvantageInputs(act_valid=jnp.asarray(act_valid), step_mask=jnp.asarray(step_mask),
                           terminal=jnp.asarray(last), truncated=jnp.zeros((S, B), bool),
                           score=jnp.asarray(score), agent_score=jnp.asarray(np.repeat(score[..., None], N, -1)))


def _acfg(level="action", group_size=4, scale="std", **algo) -> AdvantageConfig:
    return AdvantageConfig(algo=AlgoConfig(level=level, advantage="group", group_scale=scale, **algo),
                           rollout=RolloutConfig(rows=B, group_size=group_size))


def test_group_baseline_by_hand():
    r = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    got = np.asarray(advantages.group_baselined(r, 4, "none"))
    np.testing.assert_allclose(got, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    got = np.asarray(advantages.group_baselined(r, 4, "std"))
    np.testing.assert_allclose(got, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)   # std 0.5; equal rewards give 0
    with pytest.raises(ValueError, match="group_size=3"):
        advantages.group_baselined(r, 3, "std")


@pytest.mark.parametrize("level", ["action", "token"])
def test_group_credit_follows_the_chain(level):
    """Every decision point of a row gets its group-baselined return, discounted by γ per link of
    the chain back from the answer (γ = 1 at the token level by default: every token the same)."""
    score = np.asarray([1, 0, 0, 0, 1, 1, 0, 0], np.float32)
    played = np.asarray([2, 2, 1, 2, 2, 1, 2, 2])
    x = _inputs(score, steps_played=played)
    acfg = _acfg(level, scale="none", reward_to="last")
    out = advantages.estimate(x, acfg)
    assert isinstance(out, Advantages)
    a = score - np.repeat(score.reshape(2, 4).mean(1), 4)                    # [B]
    dp = np.asarray(out.dp)
    adv = np.asarray(out.adv)
    gamma = acfg.algo.discount
    # the chain's decision points of row b, in execution order: (step, agent[, token])
    for b in range(B):
        points = [idx for idx in np.argwhere(dp[:, b]) ]
        points = sorted(map(tuple, points))
        for back, p in enumerate(reversed(points)):
            np.testing.assert_allclose(adv[(p[0], b) + p[1:]], a[b] * gamma ** back, rtol=1e-6, atol=1e-7,
                                       err_msg=f"row {b} point {p}")
    assert not np.asarray(out.value).any()
    np.testing.assert_array_equal(np.asarray(out.ret), adv)                  # zero values: returns = advantages


def test_group_independent_learners_baseline_each_agent():
    """Independent learners: each agent's own mixed reward is baselined over its group."""
    x = _inputs(np.zeros(B, np.float32))
    own = np.zeros((S, B, N), np.float32)
    own[1, :, 0] = [1, 0, 0, 0, 1, 1, 1, 1]
    own[1, :, 1] = [0, 0, 0, 1, 0, 0, 0, 0]
    x = x.replace(agent_score=jnp.asarray(own), score=jnp.asarray(own.mean(-1)))
    acfg = dataclasses.replace(_acfg("action", scale="none", ippo_own_weight=1.0), independent=True)
    out = advantages.estimate(x, acfg)
    want = own[1] - np.repeat(own[1].reshape(2, 4, N).mean(1), 4, axis=0)     # [B, N]
    np.testing.assert_allclose(np.asarray(out.adv)[1], want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.adv)[0], 0.99 * want, atol=1e-6)   # each agent's own earlier step


def test_gae_is_the_backup_of_the_critics_values():
    """``gae`` through the seam is :func:`marft_gae` of the placed reward and the values."""
    x = _inputs(np.asarray([1, 0, 0, 0, 1, 1, 0, 0], np.float32))
    value = jax.random.normal(jax.random.key(0), (S, B, N))
    x = x.replace(value=value, v_boot=jnp.zeros((B, N)))
    acfg = AdvantageConfig(algo=AlgoConfig(level="action"))
    out = advantages.estimate(x, acfg)
    dp = np.asarray(out.dp)
    adv, ret = backups.marft_gae(out.placed, jnp.where(dp, value, 0.0), out.dp, x.step_mask, x.terminal, x.truncated,
                                 jnp.zeros(B), gamma=0.99, lam=0.95)
    np.testing.assert_array_equal(np.asarray(out.adv), np.asarray(adv))
    np.testing.assert_array_equal(np.asarray(out.ret), np.asarray(ret))


def test_keys_name_themselves():
    from marft_jax.train.build import check_names

    with pytest.raises(ConfigError, match="algo.advantage='nope'.*gae.*group"):
        check_names(load_config("demo", ["algo.advantage=nope"]))
    with pytest.raises(ConfigError, match="rollout.group_size=3: must be a divisor of rollout.rows"):
        load_config("demo", ["rollout.group_size=3"])
    with pytest.raises(ConfigError, match="algo.group_scale"):
        load_config("demo", ["algo.group_scale=mad"])
    with pytest.raises(ConfigError, match="rollout.group_size=1: must be >= 2 with algo.advantage=group"):
        check_names(load_config("demo", ["algo.advantage=group"]))
    with pytest.raises(ConfigError, match="ppo.critic_warmup=2: must be 0 with algo.advantage='group'"):
        check_names(load_config("demo", ["algo.advantage=group", "rollout.group_size=4", "ppo.critic_warmup=2"]))
    check_names(load_config("demo", ["algo.advantage=group", "rollout.group_size=4"]))


def test_problem_stream_repeats_each_problem_group_size_times():
    from marft_jax.train.trainer import ProblemStream

    task = RelayTask(10)
    stream = ProblemStream(task, seed=0)
    got = stream.take(8, group_size=4)
    want = list(itertools.islice(task.problems("train", 0), 2))
    assert got == [want[0]] * 4 + [want[1]] * 4
    assert stream.position == 2


# A third estimator, in this file alone: REINFORCE with the batch's mean reward as baseline,
# the same advantage on every decision point of a row.
@advantages.register("test_reinforce", needs_critic=False)
def _reinforce(x: AdvantageInputs, acfg: AdvantageConfig) -> Advantages:
    dp = advantages.decision_points(x.act_valid, x.step_mask, acfg.algo.token_level)
    r = advantages.episode_reward(x, acfg)                                   # [B]
    a = r - r.mean()
    adv = jnp.where(dp, a.reshape((1, -1) + (1,) * (dp.ndim - 2)), 0.0)
    return Advantages(jnp.zeros(dp.shape), dp, adv, adv, adv)


def _parity_score(transcripts):
    """A reward that varies between a random base's samples: the parity of the answer's characters."""
    from marft_jax.envs.task import Score

    return [Score(float(sum(map(ord, t.answer_text)) % 2), {}) for t in transcripts]


def _learner(algo: AlgoConfig, rows: int, group_size: int, *, base=None, seed: int = 0, score_fn=None):
    tok = ToyChatTokenizer()
    cfg = model_config(tok)
    if base is None:
        from marft_jax.models import decoder
        base = decoder.init_params(jax.random.key(seed), cfg, std=0.1)
    task = RelayTask(10)
    optim = OptimConfig(policy_lr=2e-3, critic_lr=1e-2)
    rcfg = RolloutConfig(rows=rows, group_size=group_size, max_new_tokens=2, context_window=64)
    ppo = PPOConfig(epochs=2, num_minibatches=2, kl_stop=0.05, ent_coef=0.0, max_grad_norm=1.0)
    learner = TeamLearner(
        cfg=cfg, base=base, tokenizer=tok, sampler=Sampler(cfg, pad_id=tok.pad_id, stop_ids=tok.stop_ids),
        team=Team(roles=("a", "b"), system_prompts=("s", "s"), answer_agent=1),
        score_fn=score_fn or (lambda ts: [task.score(t) for t in ts]), rollout_cfg=rcfg,
        update_cfg=UpdateConfig(algo=algo, optim=optim, ppo=ppo), adv_cfg=AdvantageConfig(algo=algo, rollout=rcfg))
    lora_cfg = LoraConfig(rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    state = init_train_state(jax.random.key(seed + 1), cfg, lora_cfg, 2, optim,
                             critic=advantages.needs_critic(algo))
    return learner, state, task


def _groups(task: RelayTask, seed: int, rows: int, group_size: int):
    problems = task.problems("train", seed)
    while True:
        yield [p for p in itertools.islice(problems, rows // group_size) for _ in range(group_size)]


@pytest.mark.parametrize("name", ["group", "test_reinforce"])
def test_critic_free_iteration_has_no_critic(name, tmp_path):
    """One iteration: the adapters move, nothing of a critic exists or runs, and the state's
    checkpoint round-trips."""
    from marft_jax.train.checkpoint import CheckpointManager

    algo = AlgoConfig(level="action", advantage=name)
    learner, state, task = _learner(algo, rows=8, group_size=4, score_fn=_parity_score)
    assert state.critic is None and state.critic_opt is None
    before = jax.tree.map(np.asarray, state.lora)
    state, m, _ = learner.iteration(state, next(_groups(task, 0, 8, 4)), iteration=0, env_samples=0,
                                    key=jax.random.key(3))
    assert state.critic is None and state.critic_opt is None
    assert not [k for k in m if k.startswith("critic/")], "no critic metric without a critic"
    assert m["perf/tokens/prepare/computed"] == 0, "no feature pass"
    assert m["actor/trained_agents"] == 2
    moved = [float(np.abs(np.asarray(a) - b).max()) for a, b in zip(jax.tree.leaves(state.lora), jax.tree.leaves(before))]
    assert max(moved) > 0, "the adapters must move"
    ckpt = CheckpointManager(tmp_path / "ckpt", keep_last=1, async_save=False)
    ckpt.save(1, state, {"note": "critic-free"})
    ckpt.wait()
    restored, extra = ckpt.restore(target_state=jax.tree.map(jnp.zeros_like, state))
    assert restored.critic is None and extra["note"] == "critic-free"
    raw = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(raw(a)), np.asarray(raw(b)))


def test_a_critic_free_estimator_refuses_a_critic():
    algo = AlgoConfig(level="action", advantage="group")
    learner, state, task = _learner(algo, rows=8, group_size=4)
    lora_cfg = LoraConfig(rank=8, alpha=16)
    with_critic = init_train_state(jax.random.key(1), learner.cfg, lora_cfg, 2, OptimConfig())
    with pytest.raises(ValueError, match="algo.advantage='group' is critic-free"):
        learner.iteration(with_critic, next(_groups(task, 0, 8, 4)), iteration=0, env_samples=0,
                          key=jax.random.key(3))


@pytest.mark.slow
@pytest.mark.usefixtures("xla_optimized")
def test_group_learns_the_relay():
    """The critic-free team learns the relay that needs the chain (tests/test_learning.py's task,
    base and hyper-parameters; 32 problems x 4 episodes per iteration)."""
    from tests.test_learning import pretrained_base

    rows, g = 128, 4
    algo = AlgoConfig(level="action", advantage="group", gamma=1.0)
    learner, state, task = _learner(algo, rows, g, base=pretrained_base(0))
    acc, env, key = [], 0, jax.random.key(2)
    for it, batch in zip(range(30), _groups(task, 0, rows, g)):
        key, k = jax.random.split(key)
        state, m, _ = learner.iteration(state, batch, iteration=it, env_samples=env, key=k)
        env = m["env_samples"]
        acc.append(m["episode/accuracy"])
        if it >= 10 and np.mean(acc[-5:]) >= 0.9:
            break
    print("group", [round(a, 2) for a in acc])
    assert np.mean(acc[:2]) < 0.25, "the team must start near chance (0.1)"
    assert np.mean(acc[-5:]) >= 0.9, "group must reach a team accuracy of 0.9 within 30 iterations"
