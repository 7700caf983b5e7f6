"""Sequence packing: placements, packed forwards equal padded ones, the packed update equals the padded one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import causal_attention, decoder, logprobs
from marft_jax.config import AlgoConfig, LoraConfig, OptimConfig, PPOConfig
from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import init_lora
from marft_jax.rl import packing
from marft_jax.rl.state import init_train_state
from marft_jax.rl.update import UpdateBatch, UpdateConfig, ppo_update

CFG = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def test_first_fit_decreasing_places_without_overlap():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 50, 40)
    place = packing.first_fit_decreasing(lengths, 64)
    used = np.zeros((place.rows, 64), int)
    for n, r, o in zip(lengths, place.row, place.start):
        used[r, o:o + n] += 1
    assert used.max() == 1
    assert used.sum() == lengths.sum()
    assert place.rows <= int(np.ceil(lengths.sum() / 64 * 11 / 9)) + 1   # FFD's bound
    with pytest.raises(ValueError, match="does not fit"):
        packing.first_fit_decreasing([65], 64)


def test_shape_policy_reuses_a_fitting_shape():
    pol = packing.ShapePolicy()
    first = pol.choose([[100, 90, 30], [50]])
    assert first[-1][1] >= 100 and all(t % packing.ROW_ALIGN == 0 for _, t in first)
    assert pol.fits([[100, 90, 30], [50]], first)
    again = pol.choose([[95, 80, 20], [40]])
    assert again == first and len(pol.seen) == 1
    bigger = pol.choose([[400, 300]])
    assert bigger[-1][1] >= 400 and len(pol.seen) == 2


def test_shape_policy_splits_long_and_short_sequences_into_classes():
    """Bimodal lengths (the reference workload: steps of ~300 and ~850 tokens): short sequences get
    rows of their own length instead of paying a long row's attention."""
    groups = [[317, 310, 320, 300, 857, 850, 840, 860]] * 2
    single = packing.ShapePolicy(max_classes=1, attention_cost=1 / 1500)
    multi = packing.ShapePolicy(max_classes=3, attention_cost=1 / 1500)
    s1, s3 = single.choose(groups), multi.choose(groups)
    assert len(s1) == 1 and len(s3) >= 2
    assert multi.cost(s3) < single.cost(s1)
    assert [t for _, t in s3] == sorted(t for _, t in s3)
    assert s3[0][1] < 857 <= s3[-1][1]
    for g in groups:   # every sequence has a class and the rows hold them
        cls = packing.class_of(g, [t for _, t in s3])
        for c, (r, t) in enumerate(s3):
            assert packing.first_fit_decreasing(np.asarray(g)[cls == c], t).rows <= r
    # Without attention cost one class of long rows is as cheap: no extra class is taken.
    assert len(packing.ShapePolicy(attention_cost=0.0).choose(groups)) == 1


def test_full_classes_overflow_to_longer_rows():
    shape = ((1, 64), (2, 128))
    placed = packing.place_classes([60, 50, 40, 100], shape)   # 60 fills the 64-row: 50 and 40 move up
    assert placed is not None
    (short, _), (long_, place) = placed
    assert short.tolist() == [0] and sorted(long_.tolist()) == [1, 2, 3] and place.rows == 2
    assert packing.place_classes([60, 50, 40, 100, 100], shape) is None
    assert packing.place_classes([129], shape) is None
    assert packing.first_fit_decreasing([30, 30, 30], 32, max_rows=2).row.tolist() == [0, 1, -1]
    seqs = [np.arange(n) for n in (60, 50, 40, 100)]
    classes, gather = packing.pack_group(seqs, [0, 0, 0, 0], 1, shape)
    flat = np.concatenate([c.tokens.reshape(-1) for c in classes])
    assert [int(flat[g[0]]) for g in gather] == [0, 0, 0, 0]            # each gathers its own first token
    assert int(np.concatenate([c.segment_ids.reshape(-1) for c in classes])[gather[3, 0]]) == 4
    with pytest.raises(ValueError, match="do not fit the packed shape 1x64\\+2x128"):
        packing.pack_group(seqs + [np.arange(100)], [0] * 5, 1, shape)


def test_a_seen_shape_grows_rows_instead_of_churning():
    pol = packing.ShapePolicy(attention_cost=1 / 1500, seen=[((2, 64), (2, 128))])
    shape = pol.choose([[60, 60, 120, 120, 120]])   # one more long sequence than the 128-rows hold
    assert shape == ((2, 64), (3, 128)) and pol.seen[-1] == shape
    assert pol.fits([[60, 60, 120, 120]], shape)     # and it still holds the old lengths


def test_class_of_and_shape_json():
    np.testing.assert_array_equal(packing.class_of([0, 1, 64, 65, 128], [64, 128]), [0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="does not fit"):
        packing.class_of([129], [64, 128])
    assert packing.shape_from_json([3, 64]) == ((3, 64),)                 # checkpoints before classes
    assert packing.shape_from_json([[1, 32], [2, 96]]) == ((1, 32), (2, 96))
    assert packing.format_shape(((1, 32), (2, 96))) == "1x32+2x96"
    assert packing.shape_slots(((1, 32), (2, 96))) == 224


def _tiny(seed=0):
    base = decoder.init_params(jax.random.key(seed), CFG, std=0.3)
    lora = init_lora(jax.random.key(seed + 1), CFG, LoraConfig(rank=4), 3)
    lora = lora.replace(b={k: 0.3 * jax.random.normal(jax.random.key(seed + 2), v.shape) for k, v in lora.b.items()})
    return base, lora


def _random_rows(rng, n, L, K):
    ctx = rng.integers(1, CFG.vocab_size, (n, L)).astype(np.int32)
    ctx_valid = np.arange(L) >= rng.integers(0, L - 1, (n, 1))
    act = rng.integers(1, CFG.vocab_size, (n, K)).astype(np.int32)
    act_valid = np.arange(K) < rng.integers(0, K + 1, (n, 1))
    return ctx, ctx_valid, act, act_valid


def test_packed_logprobs_equal_padded():
    base, lora = _tiny()
    rng = np.random.default_rng(1)
    n, L, K = 7, 12, 6
    ctx, cv, act, av = _random_rows(rng, n, L, K)
    agent = jnp.int32(1)
    ref_lp, ref_ent = logprobs.action_logprobs(base, lora, agent, ctx, cv, act, av, 0.7, cfg=CFG)
    seqs = [packing.sequence(ctx[j], cv[j], act[j], av[j]) for j in range(n)]
    lengths = [len(s) for s in seqs]
    fn = jax.jit(logprobs.packed_action_logprobs_fn, static_argnames=("cfg",))
    # One class of 32-slot rows, and two classes (short sequences in rows of their own length).
    ffd = lambda keep, t: packing.first_fit_decreasing([n for n in lengths if keep(n)], t).rows
    for shape in (((4, 32),), ((ffd(lambda n: n <= 10, 10), 10), (ffd(lambda n: n > 10, 18), 18))):
        packed, gather = packing.pack_group(seqs, np.maximum(cv.sum(-1) - 1, 0), K, shape)
        assert len(packed) == len(shape)
        lp, ent = fn(base, lora, agent, jax.tree.map(jnp.asarray, packed), jnp.asarray(gather), act, av, 0.7, cfg=CFG)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=2e-5)
        np.testing.assert_allclose(np.asarray(ent), np.asarray(ref_ent), atol=2e-5)


def _update_setup(level, seed=0, S=2, B=4, N=2, L=10, K=5, cfg=CFG):
    rng = np.random.default_rng(seed)
    base = decoder.init_params(jax.random.key(seed), cfg, std=0.3)
    optim = OptimConfig(policy_lr=3e-2, critic_lr=1e-2, eps=1e-3)
    state = init_train_state(jax.random.key(seed + 1), cfg, LoraConfig(rank=4), N, optim)
    ctx = rng.integers(1, cfg.vocab_size, (S, B, N, L)).astype(np.int32)
    cv = np.arange(L) >= rng.integers(0, L - 2, (S, B, N, 1))
    act = rng.integers(1, cfg.vocab_size, (S, B, N, K)).astype(np.int32)
    lens = rng.integers(1, K + 1, (S, B, N))
    av = np.arange(K) < lens[..., None]
    cv[1, 0] = False                                     # an unplayed step of row 0
    av[1, 0] = False
    dp = av.any(-1) if level == "action" else av
    logp_old = np.where(av, -rng.uniform(2, 5, av.shape), 0).astype(np.float32)
    adv = np.where(dp, rng.normal(size=dp.shape), 0).astype(np.float32)
    ret = np.where(dp, rng.normal(size=dp.shape), 0).astype(np.float32)
    feats = rng.normal(size=dp.shape + (cfg.hidden_size,)).astype(np.float32)
    batch = UpdateBatch(ctx_tokens=jnp.asarray(ctx), ctx_valid=jnp.asarray(cv), act_tokens=jnp.asarray(act),
                        act_valid=jnp.asarray(av), logp_old=jnp.asarray(logp_old), adv=jnp.asarray(adv),
                        ret=jnp.asarray(ret), v_old=jnp.zeros(dp.shape), dp_mask=jnp.asarray(dp),
                        feats=jnp.asarray(feats), word_count=jnp.asarray(lens.astype(np.int32)))
    return base, state, batch, optim


def _assert_same_update(ref_state, ref_met, new_state, met):
    """The packed update's LoRA and metrics equal the padded one's."""
    for a, b in zip(jax.tree.leaves(ref_state.lora), jax.tree.leaves(new_state.lora)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    for a, b in zip(jax.tree.leaves(ref_met), jax.tree.leaves(met)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("level,classes,L", [("action", None, 10), ("token", None, 10),
                                            ("action", ((4, 64), (2, 96)), 80)])
def test_packed_update_equals_padded(level, classes, L):
    base, state, batch, optim = _update_setup(level, L=L)
    ucfg = UpdateConfig(algo=AlgoConfig(level=level), optim=optim,
                        ppo=PPOConfig(kl_stop=None, ent_coef=0.01, epochs=2, num_minibatches=2, micro_batches=2))
    mask, flag = jnp.ones((2,), bool), jnp.asarray(True)
    copy = lambda t: jax.tree.map(jnp.copy, t)
    ref_state, ref_met = ppo_update(base, copy(state), batch, mask, flag, cfg=CFG, ucfg=ucfg)

    perms = packing.minibatch_perms(state.rng, 4, 2, 2)
    host = jax.tree.map(np.asarray, batch)
    packed, stats = packing.pack_update(host.ctx_tokens, host.ctx_valid, host.act_tokens, host.act_valid, perms,
                                      micro_batches=2, policy=packing.ShapePolicy(
                                          reuse_slack=100.0, seen=[classes] if classes else []))
    assert stats["computed_tokens"] >= stats["valid_tokens"] > 0
    if classes:   # a compiled two-class shape that fits is reused: short and long sequences apart
        assert stats["shape"] == classes and len(packed.rows) == 2
    packed_batch = batch.replace(ctx_tokens=None, ctx_valid=None)
    new_state, met = ppo_update(base, copy(state), packed_batch, mask, flag, cfg=CFG, ucfg=ucfg,
                                packed=jax.tree.map(jnp.asarray, packed))
    _assert_same_update(ref_state, ref_met, new_state, met)
    assert not np.allclose(np.asarray(jax.tree.leaves(state.lora)[0]), np.asarray(jax.tree.leaves(new_state.lora)[0]))


def test_segment_mode_packs_units_end_to_end():
    """With attention that skips other segments' keys (the native whole-row kernel) a shape costs
    its slots: the reference workload's four ~1,000-1,500-token units per group share one row
    instead of padding four rows to the longest; units start at multiples of segment_align; row
    lengths snap to sixteenth steps, stay within max_row_len, and a shape one step larger is reused."""
    groups = [[1480, 1300, 1250, 1030], [1400, 1390, 1100, 900]]
    dense = packing.ShapePolicy(attention_cost=1 / 1500).choose(groups)
    seg = packing.ShapePolicy(attention_cost=0.0, segment_attention=True, segment_align=4)
    shape = seg.choose(groups)
    assert shape == ((1, 5120),)                      # 1,480 + 1,300 + 1,252 + 1,032 = 5,064 -> 5,120
    assert packing.shape_slots(dense) > packing.shape_slots(shape)    # dense: rows of 1,056 + 1,280 + 2 x 1,504
    assert packing.shape_slots(shape) <= 1.05 * max(sum(seg.slots_of(g)) for g in groups)
    assert seg.choose([[1500, 1400, 1200, 900]]) == shape            # fits: reused
    assert seg.choose([[1280, 1280, 1280, 1280]]) == shape            # exactly full
    bigger = seg.choose([[1504, 1504, 1504, 1000]])                  # 5,512 slots: the next grid step
    assert bigger == ((1, packing.snap_row_len(5512)),) and bigger[0][1] <= 5512 * 17 / 16
    assert seg.choose([[1500, 1400]]) == ((1, 2944),)                 # half the slots: a fresh shape
    long = seg.choose([[1000] * 20])
    assert all(t <= seg.max_row_len for _, t in long) and packing.shape_slots(long) < 1.07 * 20000
    seqs = [np.arange(n, dtype=np.int32) + 1 for n in (37, 50, 23, 64)]
    pol = packing.ShapePolicy(attention_cost=0.0, segment_attention=True, segment_align=4)
    rows, gather = packing.pack_group(seqs, [0] * 4, 1, pol.choose([[len(x) for x in seqs]]), segment_align=4)
    (r,) = rows
    seg_ids = r.segment_ids.ravel()
    starts = [int(np.flatnonzero(seg_ids == j + 1)[0]) for j in range(4)]
    assert all(s0 % 4 == 0 for s0 in starts) and r.tokens.shape[0] == 1
    for j, x in enumerate(seqs):
        np.testing.assert_array_equal(r.tokens.ravel()[seg_ids == j + 1], x)
    assert [packing.snap_row_len(n) for n in (1, 33, 1000, 1504, 4097, 5058)] == [32, 64, 1024, 1536, 4352, 5120]


@pytest.mark.skipif(not causal_attention.status().available, reason="native kernel unavailable")
def test_segment_mode_update_with_native_attention_equals_padded():
    """The packed update in segment mode (units end to end in one row per group, the native
    kernel's attention, its backward split at the units) equals the padded update on XLA."""
    cfg_xla = dataclasses.replace(CFG, head_dim=16)
    cfg_native = dataclasses.replace(cfg_xla, causal_attention="native")
    base, state, batch, optim = _update_setup("action", L=40, cfg=cfg_xla)
    ucfg = UpdateConfig(algo=AlgoConfig(level="action"), optim=optim,
                        ppo=PPOConfig(kl_stop=None, ent_coef=0.01, epochs=1, num_minibatches=1, micro_batches=1))
    mask, flag = jnp.ones((2,), bool), jnp.asarray(True)
    copy = lambda t: jax.tree.map(jnp.copy, t)
    ref_state, ref_met = ppo_update(base, copy(state), batch, mask, flag, cfg=cfg_xla, ucfg=ucfg)
    perms = packing.minibatch_perms(state.rng, 4, 1, 1)
    host = jax.tree.map(np.asarray, batch)
    policy = packing.ShapePolicy(attention_cost=0.0, segment_attention=True, segment_align=causal_attention.SEGMENT_ALIGN)
    packed, stats = packing.pack_update(host.ctx_tokens, host.ctx_valid, host.act_tokens, host.act_valid, perms,
                                        micro_batches=1, policy=policy)
    assert len(stats["shape"]) == 1 and stats["shape"][0][0] == 1            # one row per group
    assert stats["computed_tokens"] <= 1.1 * stats["valid_tokens"] + 2 * 32
    new_state, met = ppo_update(base, copy(state), batch.replace(ctx_tokens=None, ctx_valid=None), mask, flag,
                                cfg=cfg_native, ucfg=ucfg, packed=jax.tree.map(jnp.asarray, packed))
    _assert_same_update(ref_state, ref_met, new_state, met)


def test_pack_update_rejects_bad_micro_batches():
    base, state, batch, _ = _update_setup("action")
    host = jax.tree.map(np.asarray, batch)
    perms = packing.minibatch_perms(state.rng, 4, 1, 1)
    with pytest.raises(ValueError, match="ppo.micro_batches"):
        packing.pack_update(host.ctx_tokens, host.ctx_valid, host.act_tokens, host.act_valid, perms,
                            micro_batches=3, policy=packing.ShapePolicy())


def _trajectory(seed=0, S=2, B=3, N=2, L=12, K=5):
    from marft_jax.rl.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    ctx = rng.integers(1, CFG.vocab_size, (S, B, N, L)).astype(np.int32)
    cv = np.arange(L) >= rng.integers(0, L - 2, (S, B, N, 1))
    act = rng.integers(1, CFG.vocab_size, (S, B, N, K)).astype(np.int32)
    av = np.arange(K) < rng.integers(1, K + 1, (S, B, N, 1))
    step_mask = np.ones((S, B), bool)
    step_mask[1, 2] = False
    cv[1, 2], av[1, 2] = False, False
    boot = rng.integers(1, CFG.vocab_size, (B, N, L)).astype(np.int32)
    boot_valid = np.zeros((B, N, L), bool)
    boot_valid[0, :, 3:] = True
    z = np.zeros((S, B, N), np.float32)
    return Trajectory(ctx_tokens=ctx, ctx_valid=cv, act_tokens=act, act_valid=av, sample_logp=np.zeros(av.shape, np.float32),
                      word_count=z.astype(np.int32), step_mask=step_mask, terminal=np.zeros((S, B), bool),
                      truncated=np.zeros((S, B), bool), score=np.zeros((S, B), np.float32), agent_score=z,
                      boot_ctx_tokens=boot, boot_ctx_valid=boot_valid, budget_clipped=z.astype(bool))


@pytest.mark.parametrize("token_level", [False, True])
def test_packed_critic_features_equal_padded(token_level):
    from marft_jax.models.critic import CriticParams, critic_features_fn, init_value_head
    from marft_jax.train import prepare

    base, _ = _tiny()
    traj = _trajectory()
    critic = CriticParams(head=init_value_head(jax.random.key(3), CFG.hidden_size))
    feats, boot, stats = prepare.critic_features(base, critic, traj, cfg=CFG, token_level=token_level,
                                                 tokens_per_call=64, policy=packing.ShapePolicy())
    S, B, N, L, K = traj.shape
    flat = lambda x: jnp.asarray(x).reshape((-1,) + x.shape[3:])
    ref = critic_features_fn(base, flat(traj.ctx_tokens), flat(traj.ctx_valid), flat(traj.act_tokens),
                             flat(traj.act_valid), cfg=CFG, token_level=token_level)
    ref = np.asarray(ref).reshape(feats.shape)
    played = np.asarray(traj.step_mask)[:, :, None] & np.ones((1, 1, N), bool)
    if token_level:   # positions past an action's end read different (masked) states
        played = played[..., None] & np.asarray(traj.act_valid)
    np.testing.assert_allclose(feats[played], ref[played], atol=1e-5)
    ref_boot = critic_features_fn(base, jnp.asarray(traj.boot_ctx_tokens[0]), jnp.asarray(traj.boot_ctx_valid[0]),
                                  jnp.zeros((N, 1), jnp.int32), jnp.zeros((N, 1), bool), cfg=CFG, token_level=False)
    np.testing.assert_allclose(boot[0], np.asarray(ref_boot), atol=1e-5)
    assert stats["computed_tokens"] >= stats["valid_tokens"]


def test_recomputed_logprobs_equal_padded():
    from marft_jax.train import prepare

    base, lora = _tiny()
    lora = jax.tree.map(lambda x: x[:2], lora)
    traj = _trajectory()
    logp, ent, _ = prepare.recompute_logprobs(base, lora, traj, cfg=CFG, temperature=0.8, chunk=128,
                                              policy=packing.ShapePolicy())
    S, B, N, L, K = traj.shape
    for i in range(N):
        sl = lambda x: jnp.asarray(x[:, :, i]).reshape((S * B,) + x.shape[3:])
        ref, ref_ent = logprobs.action_logprobs(base, lora, jnp.int32(i), sl(traj.ctx_tokens), sl(traj.ctx_valid),
                                                sl(traj.act_tokens), sl(traj.act_valid), 0.8, cfg=CFG)
        np.testing.assert_allclose(logp[:, :, i].reshape(S * B, K), np.asarray(ref), atol=2e-5)
        np.testing.assert_allclose(ent[:, :, i].reshape(S * B, K), np.asarray(ref_ent), atol=2e-5)


def test_layout_costs_count_the_unpacked_layouts():
    cv = np.zeros((2, 2, 1, 8), bool)
    av = np.zeros((2, 2, 1, 4), bool)
    cv[0, 0, 0, 5:], av[0, 0, 0, :2] = True, True      # 3 + 2 tokens
    cv[0, 1, 0, 1:], av[0, 1, 0, :4] = True, True      # 7 + 4
    cv[1, 0, 0, 6:], av[1, 0, 0, :1] = True, True      # 2 + 1; row 1 of step 1 unplayed
    costs = packing.layout_costs(cv, av, bucket=4)
    assert costs == {"padded": 4 * 12, "step_agent_buckets": 2 * 12 + 1 * 4}
