"""Agent-by-agent update: the scan over agents against Python-loop oracles."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marft_jax.models import decoder, logprobs
from marft_jax.config import AlgoConfig, LoraConfig, OptimConfig, PPOConfig
from marft_jax.models.config import ModelConfig
from marft_jax.rl import losses
from marft_jax.rl.state import init_train_state, policy_optimizer
from marft_jax.rl.update import UpdateBatch, UpdateConfig, critic_update, ppo_update, update_agents

# One program per call, as inside ppo_update: called eagerly, the operations around the scans
# (and every operation of the oracle below) would each compile on their own (several hundred
# small programs per test, most of the file's time).
update_agents = jax.jit(update_agents, static_argnums=(1, 2))
critic_update = jax.jit(critic_update, static_argnums=(1, 2))

CFG = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
S, B, N, L, K = 1, 4, 3, 6, 5


def _setup(level="action", seed=0):
    rng = np.random.default_rng(seed)
    base = decoder.init_params(jax.random.key(seed), CFG, std=0.3)
    # Adam divides by sqrt(v) + eps: with a tiny eps, float noise in near-zero gradients (scan vs
    # vmap summation order) is amplified to O(lr); eps 1e-3 keeps comparisons meaningful.
    optim = OptimConfig(policy_lr=3e-2, critic_lr=1e-2, eps=1e-3)
    state = init_train_state(jax.random.key(seed + 1), CFG, LoraConfig(rank=4), N, optim)
    ctx = rng.integers(0, CFG.vocab_size, (S, B, N, L)).astype(np.int32)
    ctx_valid = np.arange(L) >= rng.integers(0, 3, (S, B, N, 1))
    act = rng.integers(0, CFG.vocab_size, (S, B, N, K)).astype(np.int32)
    lens = rng.integers(0, K + 1, (S, B, N))
    lens[0, 0, :] = K  # at least some full rows
    act_valid = np.arange(K) < lens[..., None]
    logp_old = np.where(act_valid, -rng.uniform(2, 5, act_valid.shape), 0).astype(np.float32)
    if level == "action":
        dp = act_valid.any(-1)
    else:
        dp = act_valid
    adv = np.where(dp, rng.normal(size=dp.shape), 0).astype(np.float32)
    ret = np.where(dp, rng.normal(size=dp.shape), 0).astype(np.float32)
    feats = rng.normal(size=dp.shape + (CFG.hidden_size,)).astype(np.float32)
    batch = UpdateBatch(ctx_tokens=jnp.asarray(ctx), ctx_valid=jnp.asarray(ctx_valid), act_tokens=jnp.asarray(act),
                        act_valid=jnp.asarray(act_valid), logp_old=jnp.asarray(logp_old), adv=jnp.asarray(adv),
                        ret=jnp.asarray(ret), v_old=jnp.zeros(dp.shape), dp_mask=jnp.asarray(dp),
                        feats=jnp.asarray(feats), word_count=jnp.asarray(lens.astype(np.int32)))
    ucfg = UpdateConfig(algo=AlgoConfig(level=level), optim=optim,
                        ppo=PPOConfig(kl_stop=None, adv_norm="none", ent_coef=0.01))
    return base, state, batch, ucfg


def _with_ppo(ucfg: UpdateConfig, **changes) -> UpdateConfig:
    return dataclasses.replace(ucfg, ppo=dataclasses.replace(ucfg.ppo, **changes))


@functools.partial(jax.jit, static_argnums=(5,))
def _oracle_agent_step(base, lora, opt, a, batch, ucfg, happo):
    """Agent a's update written directly from the public losses and optax (no scan); ``a`` is
    traced (one program for every agent)."""
    sl = lambda x: x[:, :, a].reshape((S * B,) + x.shape[3:])
    d = {f: sl(getattr(batch, f)) for f in ("ctx_tokens", "ctx_valid", "act_tokens", "act_valid",
                                             "logp_old", "adv", "dp_mask", "word_count")}
    one = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, a, 1), lora)

    def loss(l1):
        lp, ent = logprobs.action_logprobs(base, l1, 0, d["ctx_tokens"], d["ctx_valid"], d["act_tokens"],
                                           d["act_valid"], 1.0, cfg=CFG)
        if ucfg.algo.level == "token":
            s = losses.tppo_policy_loss(lp, d["logp_old"], d["dp_mask"], d["adv"] * happo[:, None],
                                        entropy=ent, ent_coef=ucfg.ppo.ent_coef)
        else:
            s = losses.appo_policy_loss(lp, d["logp_old"], d["act_valid"], d["adv"] * happo,
                                        entropy=ent, ent_coef=ucfg.ppo.ent_coef, action_mask=d["dp_mask"])
        return s.loss / jnp.maximum(s.count, 1)

    g = jax.grad(loss)(one)
    norm = optax.tree.norm(g)
    g = jax.tree.map(lambda x: x * jnp.minimum(1.0, ucfg.ppo.max_grad_norm / norm), g)
    opt_a = jax.tree.map(lambda x: x[a], opt)
    tx = policy_optimizer(ucfg.optim)  # optax.adamw(lr, eps 1e-5, wd 0) with a constant schedule
    upd, new_opt = tx.update(jax.tree.map(lambda x: x[0], g), opt_a, jax.tree.map(lambda x: x[0], one))
    new_one = optax.apply_updates(jax.tree.map(lambda x: x[0], one), upd)
    # HAPPO factor of this agent under its new parameters
    lp, _ = logprobs.action_logprobs(base, jax.tree.map(lambda x: x[None], new_one), 0, d["ctx_tokens"],
                                     d["ctx_valid"], d["act_tokens"], d["act_valid"], 1.0, cfg=CFG)
    ratio = jnp.exp(losses.action_logprob(lp, d["act_valid"]) - losses.action_logprob(d["logp_old"], d["act_valid"]))
    ratio = jnp.where(d["act_valid"].any(-1), jnp.clip(ratio, 0.8, 1.2), 1.0)
    lora = jax.tree.map(lambda full, x: full.at[a].set(x), lora, new_one)
    opt = jax.tree.map(lambda full, x: full.at[a].set(x), opt, new_opt)
    return lora, opt, happo * ratio


def _close(a, b, atol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("level", ["action", "token"])
def test_sequential_scan_equals_python_loop_with_happo(level):
    base, state, batch, ucfg = _setup(level)
    lora, opt, _ = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    o_lora, o_opt, happo = state.lora, state.lora_opt, jnp.ones(S * B)
    for a in range(N):
        o_lora, o_opt, happo = _oracle_agent_step(base, o_lora, o_opt, a, batch, ucfg, happo)
    _close(lora, o_lora)
    _close(opt, o_opt)
    assert not np.allclose(np.asarray(happo), 1.0)  # the factor was active


def test_sequential_without_happo_equals_concurrent():
    base, state, batch, ucfg = _setup()
    seq = update_agents(base, CFG, _with_ppo(ucfg, happo_weighting=False), state.lora,
                        state.lora_opt, batch, jnp.ones(N, bool))
    con = update_agents(base, CFG, _with_ppo(ucfg, agent_schedule="concurrent"), state.lora,
                        state.lora_opt, batch, jnp.ones(N, bool))
    _close(seq[:2], con[:2])
    # and HAPPO weighting does change agents after the first
    hap = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    assert not np.allclose(np.asarray(hap[0].b["q_proj"][2]), np.asarray(seq[0].b["q_proj"][2]))


def test_concurrent_equals_independent_per_agent_updates():
    base, state, batch, ucfg = _setup()
    ucfg = _with_ppo(ucfg, agent_schedule="concurrent")
    lora, opt, _ = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    for a in range(N):
        o_lora, o_opt, _ = _oracle_agent_step(base, state.lora, state.lora_opt, a, batch, ucfg, jnp.ones(S * B))
        _close(jax.tree.map(lambda x: x[a], lora), jax.tree.map(lambda x: x[a], o_lora))


def _tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("level", ["action", "token"])
def test_chain_layers_equal_todays_scan_either_way(level):
    """On the chain (one agent per layer) both ``ppo.layer_update`` options are today's scan."""
    base, state, batch, ucfg = _setup(level)
    today = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    chain = tuple((i,) for i in range(N))
    for layer_update in ("in_order", "concurrent"):
        u = dataclasses.replace(_with_ppo(ucfg, layer_update=layer_update), layers=chain)
        _tree_equal(update_agents(base, CFG, u, state.lora, state.lora_opt, batch, jnp.ones(N, bool)), today)


def test_in_order_on_a_mixture_equals_todays_scan():
    base, state, batch, ucfg = _setup()
    today = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    u = dataclasses.replace(ucfg, layers=((0, 1), (2,)))
    _tree_equal(update_agents(base, CFG, u, state.lora, state.lora_opt, batch, jnp.ones(N, bool)), today)


@pytest.mark.parametrize("layers", [((0, 1), (2,)),      # mixture: two proposers, then the aggregator
                                    ((0,), (1, 2))])     # a padded first layer
@pytest.mark.parametrize("level", ["action", "token"])
def test_concurrent_layers_equal_per_layer_oracle(layers, level):
    """Each layer's agents update as if alone from the layer's incoming factor; the next layer
    gets the product of their ratios."""
    base, state, batch, ucfg = _setup(level)
    u = dataclasses.replace(_with_ppo(ucfg, layer_update="concurrent"), layers=layers)
    lora, opt, met = update_agents(base, CFG, u, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    o_lora, o_opt, happo = state.lora, state.lora_opt, jnp.ones(S * B)
    for layer in layers:
        incoming, happo = happo, jnp.ones(S * B)
        new_lora, new_opt = o_lora, o_opt
        for a in layer:
            one_lora, one_opt, out = _oracle_agent_step(base, o_lora, o_opt, a, batch, ucfg, incoming)
            new_lora = jax.tree.map(lambda full, x: full.at[a].set(x[a]), new_lora, one_lora)
            new_opt = jax.tree.map(lambda full, x: full.at[a].set(x[a]), new_opt, one_opt)
            happo = happo * (out / incoming)                  # this agent's ratio
        o_lora, o_opt, happo = new_lora, new_opt, incoming * happo
    _close(lora, o_lora)
    _close(opt, o_opt)
    np.testing.assert_array_equal(np.asarray(met["updated"]), np.ones(N, np.float32))
    # the wide layer's second agent trains on another factor than in the one-after-another scan
    a = next(layer for layer in layers if len(layer) > 1)[1]
    seq = update_agents(base, CFG, dataclasses.replace(ucfg, layers=layers), state.lora, state.lora_opt,
                        batch, jnp.ones(N, bool))
    assert not np.allclose(np.asarray(seq[0].b["q_proj"][a]), np.asarray(lora.b["q_proj"][a]))


def test_in_order_follows_the_layers_when_they_interleave():
    """Layers ((0, 2), (1,)): the scan updates agents 0, 2, 1, the factor carried in that order."""
    base, state, batch, ucfg = _setup()
    u = dataclasses.replace(ucfg, layers=((0, 2), (1,)))
    lora, opt, _ = update_agents(base, CFG, u, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    o_lora, o_opt, happo = state.lora, state.lora_opt, jnp.ones(S * B)
    for a in (0, 2, 1):
        o_lora, o_opt, happo = _oracle_agent_step(base, o_lora, o_opt, a, batch, ucfg, happo)
    _close(lora, o_lora)
    _close(opt, o_opt)


def test_interval_changes_only_agent_k():
    base, state, batch, ucfg = _setup()
    ucfg = _with_ppo(ucfg, agent_schedule="interval")
    k = 1
    mask = jnp.arange(N) == k
    lora, opt, met = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, mask)
    for a in range(N):
        same = [np.array_equal(np.asarray(x[a]), np.asarray(y[a]))
                for x, y in zip(jax.tree.leaves((lora, opt)), jax.tree.leaves((state.lora, state.lora_opt)))]
        if a == k:
            assert not all(same)
        else:
            assert all(same), f"agent {a} changed"
    np.testing.assert_array_equal(np.asarray(met["updated"]), np.asarray(mask, np.float32))


def test_micro_batches_equal_full_batch():
    base, state, batch, ucfg = _setup("token")
    full = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    micro = update_agents(base, CFG, _with_ppo(ucfg, micro_batches=2), state.lora,
                          state.lora_opt, batch, jnp.ones(N, bool))
    _close(full[:2], micro[:2])
    for k in ("pg_loss", "entropy", "approx_kl", "grad_norm"):
        np.testing.assert_allclose(np.asarray(full[2][k]), np.asarray(micro[2][k]), atol=1e-5)


def test_kl_early_stop_skips_update():
    base, state, batch, ucfg = _setup()
    batch = batch.replace(logp_old=batch.logp_old + 5.0 * batch.act_valid)  # far from the policy
    ucfg = _with_ppo(ucfg, kl_stop=0.02)
    lora, opt, met = update_agents(base, CFG, ucfg, state.lora, state.lora_opt, batch, jnp.ones(N, bool))
    assert np.all(np.asarray(met["kl_skipped"]) == 1)
    _close((lora, opt), (state.lora, state.lora_opt), atol=0)


def test_critic_step_reduces_value_loss_and_ppo_update_runs():
    base, state, batch, ucfg = _setup()
    c, copt, m1 = critic_update(base, CFG, ucfg, state.critic, state.critic_opt, batch)
    for _ in range(20):
        c, copt, m = critic_update(base, CFG, ucfg, c, copt, batch)
    assert float(m["value_loss"]) < float(m1["value_loss"])
    ucfg = _with_ppo(ucfg, epochs=2, num_minibatches=2, adv_norm="minibatch", kl_stop=0.02)
    new_state, met = ppo_update(base, state, batch, jnp.ones(N, bool), jnp.asarray(True), cfg=CFG, ucfg=ucfg)
    assert int(new_state.step) == 1
    assert met["actor"]["pg_loss"].shape == (N,)
    assert np.isfinite(np.asarray(met["critic"]["value_loss"]))


def test_critic_warmup_keeps_policy():
    base, state, batch, ucfg = _setup()
    lora0 = jax.tree.map(np.asarray, state.lora)
    new_state, _ = ppo_update(base, state, batch, jnp.ones(N, bool), jnp.asarray(False), cfg=CFG, ucfg=ucfg)
    _close(new_state.lora, lora0, atol=0)
