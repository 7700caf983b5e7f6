"""Shared prefixes in packed rows (rl/packing.share_prefixes): a (row, agent)'s steps computed as
one trunk + branches give the same log-probs, features and update as separate sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.config import AlgoConfig, PPOConfig
from marft_jax.models import logprobs
from marft_jax.rl import packing
from marft_jax.rl.update import UpdateConfig, ppo_update
from tests.test_packing import CFG, _tiny, _trajectory, _update_setup


def _visible(unit: packing.Unit, t: int) -> np.ndarray:
    """Unit offsets token ``t`` attends to under the packed mask (causal, trunk or own branch)."""
    u = np.arange(t + 1)
    return u[(unit.branch[u] == 0) | (unit.branch[u] == unit.branch[t])]


def test_share_prefixes_gives_every_member_exactly_its_own_sequence():
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(1, 50, n).astype(np.int32)
    P, C, H = tok(40), tok(3), [tok(12), tok(15)]
    seqs = [np.concatenate([P, C, tok(5)]),                       # step 0: prompt ‖ cue ‖ response
            np.concatenate([P, H[0], C, tok(7)]),                 # step 1 repeats P, adds history
            np.concatenate([P, H[0], H[1], C, tok(4)]),           # step 2 repeats P + H0
            tok(9),                                               # another chain, alone
            np.zeros(0, np.int32)]                                # absent: no unit
    chains = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0)]
    units = packing.share_prefixes(seqs, chains, min_shared=8)
    assert sorted(u.members for u in units) == [(0, 1, 2), (3,)]
    chain = next(u for u in units if len(u.members) == 3)
    assert len(chain.tokens) == len(seqs[2]) + (len(seqs[0]) - 40) + (len(seqs[1]) - 52)
    for j, slots in zip(chain.members, chain.slots):
        np.testing.assert_array_equal(chain.tokens[slots], seqs[j])              # its tokens ...
        np.testing.assert_array_equal(chain.positions[slots], np.arange(len(seqs[j])))   # ... at its positions
        for p in range(len(seqs[j])):                                            # ... and it sees only them
            np.testing.assert_array_equal(_visible(chain, int(slots[p])), slots[:p + 1])
    # No sharing: one unit per non-empty sequence; a prefix below min_shared or a shrinking trunk splits.
    assert len(packing.share_prefixes(seqs)) == 4
    assert len(packing.share_prefixes(seqs, chains, min_shared=64)) == 4
    shrink = [seqs[2], seqs[1]]    # step order reversed: they share 52 tokens, then nothing follows
    assert [u.members for u in packing.share_prefixes(shrink, [(0, 0), (0, 1)], min_shared=8)] == [(0, 1)]
    # steps 1, 2, then 0: the trunk would shrink from 52 to 40 shared tokens, so step 0 starts a unit
    assert [u.members for u in packing.share_prefixes(seqs[:3], [(0, 2), (0, 0), (0, 1)], min_shared=8)] == [(1, 2), (0,)]


def _chained(S=3, B=4, N=2, L=96, K=6, seed=0):
    """Contexts where step s repeats step s-1's context minus its 3-token cue (the G1 raw format's
    shape): ``[S, B, N, L]`` left-padded, ``[S, B, N, K]`` actions."""
    rng = np.random.default_rng(seed)
    ctx = np.zeros((S, B, N, L), np.int32)
    cv = np.zeros((S, B, N, L), bool)
    for b in range(B):
        for i in range(N):
            trunk = list(rng.integers(1, CFG.vocab_size, rng.integers(36, 44)))
            cue = list(rng.integers(1, CFG.vocab_size, 3))
            for s in range(S):
                x = trunk + cue
                ctx[s, b, i, L - len(x):], cv[s, b, i, L - len(x):] = x, True
                trunk += list(rng.integers(1, CFG.vocab_size, rng.integers(8, 16)))
    act = rng.integers(1, CFG.vocab_size, (S, B, N, K)).astype(np.int32)
    av = np.arange(K) < rng.integers(1, K + 1, (S, B, N, 1))
    return ctx, cv, act, av


@pytest.mark.parametrize("level", ["action", "token"])
def test_update_with_shared_prefixes_equals_the_unshared_one(level):
    base, state, batch, optim = _update_setup(level, S=3, B=4, L=96, K=6)
    ctx, cv, act, av = _chained()
    dp = av.any(-1) if level == "action" else av
    rng = np.random.default_rng(5)
    batch = batch.replace(ctx_tokens=None, ctx_valid=None, act_tokens=jnp.asarray(act), act_valid=jnp.asarray(av),
                          dp_mask=jnp.asarray(dp), adv=jnp.asarray(np.where(dp, rng.normal(size=dp.shape), 0), jnp.float32),
                          logp_old=jnp.asarray(np.where(av, -3.0, 0.0), jnp.float32))
    ucfg = UpdateConfig(algo=AlgoConfig(level=level), optim=optim,
                        ppo=PPOConfig(kl_stop=None, ent_coef=0.01, epochs=1, num_minibatches=1))
    mask, flag = jnp.ones((2,), bool), jnp.asarray(True)
    perms = packing.minibatch_perms(state.rng, 4, 1, 1)
    out = {}
    for share in (False, True):
        packed, stats = packing.pack_update(ctx, cv, act, av, perms, micro_batches=1, policy=packing.ShapePolicy(),
                                          share=share)
        if share:   # each (row, agent) is one unit: its three steps' prefixes computed once
            assert stats["unique_tokens"] < 0.75 * stats["valid_tokens"]
            assert stats["computed_tokens"] < stats["valid_tokens"]
            assert packed.rows[0].branch_ids.max() == 2
        else:
            assert stats["unique_tokens"] == stats["valid_tokens"]
        copy = jax.tree.map(jnp.copy, state)
        out[share] = ppo_update(base, copy, batch, mask, flag, cfg=CFG, ucfg=ucfg, packed=jax.tree.map(jnp.asarray, packed))
    (ref_state, ref_met), (new_state, met) = out[False], out[True]
    for a, b in zip(jax.tree.leaves(ref_state.lora), jax.tree.leaves(new_state.lora)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    for a, b in zip(jax.tree.leaves(ref_met), jax.tree.leaves(met)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)


def test_shared_prefix_logprobs_equal_a_padded_forward():
    base, lora = _tiny()
    ctx, cv, act, av = _chained(S=3, B=2, N=1)
    perms = np.arange(2, dtype=np.int32)[None, None]
    packed, stats = packing.pack_update(ctx, cv, act, av, perms, micro_batches=1, policy=packing.ShapePolicy(), share=True)
    assert stats["unique_tokens"] < stats["valid_tokens"]
    rows = jax.tree.map(lambda x: jnp.asarray(x[0, 0, 0]), packed.rows)
    flat = lambda x: jnp.asarray(x[:, :, 0].reshape((-1,) + x.shape[3:]))
    fn = jax.jit(logprobs.packed_action_logprobs_fn, static_argnames=("cfg",))
    lp, ent = fn(base, lora, jnp.int32(1), rows, jnp.asarray(packed.gather[0, 0, 0]), flat(act), flat(av), 0.7, cfg=CFG)
    ref_lp, ref_ent = logprobs.action_logprobs(base, lora, jnp.int32(1), flat(ctx), flat(cv), flat(act), flat(av),
                                               0.7, cfg=CFG)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(ref_ent), atol=2e-5)


@pytest.mark.parametrize("token_level", [False, True])
def test_shared_prefix_critic_features_and_recompute_equal_unshared(token_level):
    from marft_jax.models.critic import CriticParams, init_value_head
    from marft_jax.train import prepare

    base, lora = _tiny()
    lora = jax.tree.map(lambda x: x[:2], lora)
    ctx, cv, act, av = _chained(S=2, B=3, N=2)
    t = _trajectory(S=2, B=3, N=2, L=96, K=6)
    boot = np.zeros_like(t.boot_ctx_tokens)
    boot_valid = np.zeros_like(t.boot_ctx_valid)
    boot[0], boot_valid[0] = ctx[1, 0], cv[1, 0]       # row 0 bootstraps from a context like its last step's
    traj = t.replace(ctx_tokens=ctx, ctx_valid=cv, act_tokens=act, act_valid=av, boot_ctx_tokens=boot,
                     boot_ctx_valid=boot_valid, step_mask=np.ones((2, 3), bool))
    critic = CriticParams(head=init_value_head(jax.random.key(3), CFG.hidden_size))
    res = {share: prepare.critic_features(base, critic, traj, cfg=CFG, token_level=token_level, tokens_per_call=512,
                                          policy=packing.ShapePolicy(), share=share) for share in (False, True)}
    assert res[True][2]["unique_tokens"] < res[False][2]["unique_tokens"]
    play = av if token_level else np.ones(av.shape[:3], bool)    # past an action's end: masked downstream
    np.testing.assert_allclose(res[True][0][play], res[False][0][play], atol=1e-5)
    np.testing.assert_allclose(res[True][1][0], res[False][1][0], atol=1e-5)   # rows 1, 2 do not bootstrap
    if not token_level:
        rec = {share: prepare.recompute_logprobs(base, lora, traj, cfg=CFG, temperature=0.8, chunk=128,
                                                 policy=packing.ShapePolicy(), share=share) for share in (False, True)}
        np.testing.assert_allclose(rec[True][0], rec[False][0], atol=2e-5)
        np.testing.assert_allclose(rec[True][1], rec[False][1], atol=2e-5)
        assert rec[True][2]["unique_tokens"] < rec[False][2]["unique_tokens"]
