"""The prepare step's device part is one jitted program (train/prepare.py): after the host's
packing plan and one upload, the feature pass, value head, bootstrap values and backups run
without a device -> host transfer until the metrics' one fetch at the end, and give what the
stage-by-stage path (features on the host, value head, bootstrap values, ``_advantages``) gives."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.config import AlgoConfig, PPOConfig
from marft_jax.models.critic import CriticParams, init_value_head, value_head
from marft_jax.rl import advantages, packing
from marft_jax.train import prepare
from marft_jax.train.compile_count import CompileCounter
from tests.test_packing import CFG, _tiny, _trajectory


def _episodes():
    """The packing tests' trajectory with rewards, a termination and a truncation that bootstraps."""
    traj = _trajectory()
    terminal, truncated = np.zeros((2, 3), bool), np.zeros((2, 3), bool)
    terminal[1, 1], terminal[0, 2], truncated[1, 0] = True, True, True   # row 0 bootstraps (boot_valid[0])
    score = np.zeros((2, 3), np.float32)
    score[1, 1], score[0, 2] = 1.0, 0.5
    rng = np.random.default_rng(7)
    policy_logp = np.where(traj.act_valid, -rng.uniform(1, 4, traj.act_valid.shape), 0).astype(np.float32)
    return traj.replace(terminal=terminal, truncated=truncated, score=score,
                        agent_score=np.repeat(score[..., None], 2, -1), policy_logp=policy_logp,
                        entropy=np.where(traj.act_valid, 2.0, 0.0).astype(np.float32))


def _stage_by_stage(base, critic, traj, acfg):
    """The reference: each stage its own call, the features and bootstrap values on the host."""
    feats, boot, _ = prepare.critic_features(base, critic, traj, cfg=CFG, token_level=acfg.algo.token_level,
                                             tokens_per_call=acfg.tokens_per_call, policy=packing.ShapePolicy(),
                                             share=acfg.share_prefixes)
    value = np.asarray(value_head(critic.head, jnp.asarray(feats)))
    v_boot = np.where(np.asarray(traj.boot_ctx_valid).any(-1),
                      np.asarray(value_head(critic.head, jnp.asarray(boot))), 0.0).astype(np.float32)
    value, dp, placed, adv, ret = advantages.advantages(
        *(jnp.asarray(x) for x in (value, traj.act_valid, traj.step_mask, traj.score, traj.agent_score,
                                   traj.terminal, traj.truncated, v_boot)), acfg=acfg)
    return {"feats": feats, "v_old": value, "dp_mask": dp, "adv": adv, "ret": ret}


@pytest.mark.parametrize("level,logp_old", [("action", "sampler"), ("token", "sampler"), ("action", "recompute")])
def test_prepare_is_one_program_with_no_transfer_before_the_end(level, logp_old, no_persistent_compile_cache):
    base, lora = _tiny()
    lora = jax.tree.map(lambda x: x[:2], lora)
    critic = CriticParams(head=init_value_head(jax.random.key(3), CFG.hidden_size))
    traj = _episodes()
    acfg = advantages.AdvantageConfig(algo=AlgoConfig(level=level, reward_bias=-0.25), ppo=PPOConfig(logp_old=logp_old),
                                   tokens_per_call=64)
    shapes = prepare.PrepareShapes()
    run = lambda: prepare.prepare_update_batch(base, lora, critic, traj, cfg=CFG, acfg=acfg, shapes=shapes)
    jax.clear_caches()        # every program the call runs compiles now, and shows in the counter
    # "disallow" refuses implicit transfers (np.asarray of a device array); the metrics' one
    # fetch at the end is an explicit jax.device_get.
    with jax.transfer_guard_device_to_host("disallow"):
        with CompileCounter.counting() as first:
            batch, metrics = run()
            jax.block_until_ready(batch)
        with CompileCounter.counting() as again:
            jax.block_until_ready(run()[0])
    want = {"jit(_values_and_backups)": 1} | ({"jit(_packed_logprobs)": 1} if logp_old == "recompute" else {})
    assert first.names == want
    assert again.compiles == 0

    ref = _stage_by_stage(base, critic, traj, acfg)
    for name, x in ref.items():
        np.testing.assert_allclose(np.asarray(getattr(batch, name)), np.asarray(x), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    adv = np.asarray(batch.adv)[np.asarray(batch.dp_mask)]
    assert np.abs(adv).max() > 0 and metrics["rewards/placed_sum_mean"] != 0.0
    if logp_old == "recompute":
        logp, _, _ = prepare.recompute_logprobs(base, lora, traj, cfg=CFG, temperature=acfg.rollout.temperature,
                                                chunk=acfg.chunk, policy=packing.ShapePolicy())
        np.testing.assert_array_equal(np.asarray(batch.logp_old), np.asarray(logp))
        assert metrics["rollout/logp_mismatch"] > 0
    else:
        np.testing.assert_array_equal(np.asarray(batch.logp_old), traj.policy_logp)
        assert "rollout/logp_mismatch" not in metrics


def test_independent_backup_in_the_program_matches_stage_by_stage():
    base, _ = _tiny()
    critic = CriticParams(head=init_value_head(jax.random.key(3), CFG.hidden_size))
    traj = _episodes()
    traj = traj.replace(agent_score=traj.agent_score * np.array([1.0, 0.5], np.float32))
    acfg = dataclasses.replace(advantages.AdvantageConfig(tokens_per_call=64), independent=True)
    batch, _ = prepare.prepare_update_batch(base, None, critic, traj, cfg=CFG, acfg=acfg)
    for name, x in _stage_by_stage(base, critic, traj, acfg).items():
        np.testing.assert_allclose(np.asarray(getattr(batch, name)), np.asarray(x), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
