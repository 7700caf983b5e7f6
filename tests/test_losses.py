"""PPO losses: (sum, count) exactness over uneven micro-batches, worked examples, edge cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marft_jax.rl import losses

# §6 worked example advantages in [agent, token] layout, K = 3; agent 1 has 2 tokens.
WE_A = np.array([[0.047644672, 0.0106176, 0.34808], [0.164, 0.2, 0.0]], np.float32)
WE_MASK = np.array([[True, True, True], [True, True, False]])


def test_normalization_worked_example():
    mean, std = losses.masked_mean_std(jnp.asarray(WE_A), jnp.asarray(WE_MASK))
    np.testing.assert_allclose(float(mean), 0.1540684544, atol=1e-7)
    np.testing.assert_allclose(float(std), 0.1197939826, atol=1e-7)
    norm = losses.normalize_advantages(jnp.asarray(WE_A), jnp.asarray(WE_MASK))
    np.testing.assert_allclose(np.asarray(norm), [[-0.888390, -1.197480, 1.619543],
                                                  [0.082905, 0.383421, 0.0]], atol=2e-6)
    assert float(norm[1, 2]) == 0.0
    # a padding entry holding garbage does not move the statistics (G1 quirk #13 not reproduced)
    padded = WE_A.copy()
    padded[1, 2] = 123.0
    np.testing.assert_allclose(losses.normalize_advantages(jnp.asarray(padded), jnp.asarray(WE_MASK)),
                               norm, atol=1e-7)
    # a genuine zero advantage is kept (G1 drops exact zeros)
    z = np.array([0.0, 1.0, 2.0], np.float32)
    nz = losses.normalize_advantages(jnp.asarray(z), jnp.ones(3, bool))
    np.testing.assert_allclose(np.asarray(nz), (z - 1.0) / (np.sqrt(2 / 3) + 1e-8), atol=1e-6)
    np.testing.assert_array_equal(
        losses.normalize_advantages(jnp.asarray(WE_A), jnp.asarray(WE_MASK), mode="none"),
        np.where(WE_MASK, WE_A, 0.0))
    with pytest.raises(ValueError, match="adv_norm"):
        losses.normalize_advantages(jnp.asarray(WE_A), jnp.asarray(WE_MASK), mode="group")


def test_empty_masks_give_zero_not_nan():
    x = jnp.full((2, 3, 4), jnp.nan)
    m = jnp.zeros((2, 3, 4), bool)
    assert float(losses.masked_mean(x, m)) == 0.0
    mean, std = losses.masked_mean_std(x, m)
    assert float(mean) == 0.0 and float(std) == 0.0
    assert np.all(np.asarray(losses.normalize_advantages(x, m)) == 0.0)
    am = jnp.zeros((2, 3), bool)
    out = losses.appo_policy_loss(x, x, m, jnp.zeros((2, 3)), entropy=x, ent_coef=0.01,
                                  norm="word", word_count=jnp.zeros((2, 3), jnp.int32))
    loss, metrics = losses.finalize(out)
    assert float(out.count) == 0.0 and float(loss) == 0.0
    assert all(float(v) == 0.0 for v in metrics.values())
    out = losses.tppo_policy_loss(x, x, m, x, entropy=x, ent_coef=0.01)
    assert float(losses.finalize(out)[0]) == 0.0
    out = losses.value_loss(x, x, x, m)
    assert float(losses.finalize(out)[0]) == 0.0
    assert float(losses.action_logprob(x, m, norm="token")[0, 0]) == 0.0
    del am


def test_huber_is_symmetric_and_matches_optax():
    e = jnp.arange(-60, 61, dtype=jnp.float32) * 0.5
    h = losses.huber(e, 10.0)
    np.testing.assert_allclose(h, optax.huber_loss(e, delta=10.0), rtol=1e-6)
    np.testing.assert_allclose(h, h[::-1], rtol=1e-6)
    # G1's bug gave zero loss for errors below -delta (quirk #7); ours is delta * (|e| - delta/2)
    assert float(losses.huber(jnp.array(-25.0), 10.0)) == pytest.approx(10.0 * (25.0 - 5.0))
    out = losses.value_loss(jnp.array([25.0]), jnp.array([25.0]), jnp.array([0.0]),
                            jnp.array([True]), clip_eps=None)
    assert float(out.loss) == pytest.approx(200.0)


def _np_huber(e, d):
    a = np.abs(e)
    return np.where(a <= d, 0.5 * e * e, d * (a - 0.5 * d))


@pytest.mark.parametrize("kind", ["huber", "mse"])
def test_value_loss_matches_numpy(kind):
    rng = np.random.default_rng(0)
    shape = (2, 3, 2, 5)
    v, v_old = rng.normal(size=shape) * 8, rng.normal(size=shape) * 8
    ret = rng.normal(size=shape) * 20
    m = rng.random(shape) < 0.6
    out = losses.value_loss(*(jnp.asarray(x, jnp.float32) for x in (v, v_old, ret)), jnp.asarray(m),
                            clip_eps=0.2, kind=kind, coef=0.5)
    h = (lambda e: _np_huber(e, 10.0)) if kind == "huber" else (lambda e: 0.5 * e * e)
    v_clip = v_old + np.clip(v - v_old, -0.2, 0.2)
    per = np.maximum(h(ret - v), h(ret - v_clip))
    np.testing.assert_allclose(float(out.loss), 0.5 * per[m].sum(), rtol=1e-5)
    assert float(out.count) == m.sum()
    np.testing.assert_allclose(float(out.metrics["value_loss"]), per[m].sum(), rtol=1e-5)


def _np_appo(lp_new, lp_old, mask, adv, eps, norm, words, ent, c_h):
    k = mask.sum(-1)
    l_new, l_old = (np.where(mask, x, 0).sum(-1) for x in (lp_new, lp_old))
    if norm == "token":
        l_new, l_old = l_new / np.maximum(k, 1), l_old / np.maximum(k, 1)
    elif norm == "word":
        l_new, l_old = l_new / np.maximum(words, 1), l_old / np.maximum(words, 1)
    rho = np.exp(l_new - l_old)
    surr = -np.minimum(rho * adv, np.clip(rho, 1 - eps, 1 + eps) * adv)
    hbar = np.where(mask, ent, 0).sum(-1) / np.maximum(k, 1)
    valid = k > 0
    n = max(valid.sum(), 1)
    return (surr[valid].sum() - c_h * hbar[valid].sum()) / n, ((rho - 1 - np.log(rho))[valid]).sum() / n


@pytest.mark.parametrize("norm", ["sum", "token", "word"])
def test_appo_matches_numpy(norm):
    rng = np.random.default_rng(1)
    shape = (2, 4, 3, 6)
    lengths = rng.integers(0, 7, size=shape[:-1])
    mask = np.arange(6) < lengths[..., None]
    lp_old = -rng.random(shape) * 2
    lp_new = lp_old + rng.normal(size=shape) * 0.1
    adv = rng.normal(size=shape[:-1])
    words = rng.integers(0, 4, size=shape[:-1])
    ent = rng.random(shape) * 3
    out = losses.appo_policy_loss(*(jnp.asarray(x, jnp.float32) for x in (lp_new, lp_old)),
                                  jnp.asarray(mask), jnp.asarray(adv, jnp.float32), clip_eps=0.2,
                                  norm=norm, word_count=jnp.asarray(words),
                                  entropy=jnp.asarray(ent, jnp.float32), ent_coef=0.01)
    loss, metrics = losses.finalize(out)
    want_loss, want_kl = _np_appo(lp_new, lp_old, mask, adv, 0.2, norm, words, ent, 0.01)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["approx_kl"]), want_kl, rtol=1e-3, atol=1e-7)
    assert float(out.count) == (lengths > 0).sum()


def test_tppo_matches_numpy_and_clip_fraction():
    rng = np.random.default_rng(2)
    shape = (2, 3, 2, 5)
    mask = rng.random(shape) < 0.7
    lp_old = -rng.random(shape) * 2
    lp_new = lp_old + rng.normal(size=shape) * 0.3
    adv = rng.normal(size=shape)
    ent = rng.random(shape)
    out = losses.tppo_policy_loss(*(jnp.asarray(x, jnp.float32) for x in (lp_new, lp_old)),
                                  jnp.asarray(mask), jnp.asarray(adv, jnp.float32), clip_eps=0.2,
                                  entropy=jnp.asarray(ent, jnp.float32), ent_coef=0.01)
    rho = np.exp(lp_new - lp_old)
    surr = -np.minimum(rho * adv, np.clip(rho, 0.8, 1.2) * adv)
    np.testing.assert_allclose(float(out.loss), surr[mask].sum() - 0.01 * ent[mask].sum(), rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["clip_frac"]), (np.abs(rho - 1) > 0.2)[mask].sum())
    np.testing.assert_allclose(float(out.metrics["approx_kl"]),
                               (rho - 1 - np.log(rho))[mask].sum(), rtol=1e-3)
    assert float(out.count) == mask.sum()


def test_entropy_bonus_levels():
    ent = jnp.array([[1.0, 3.0, 9.0], [2.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    m = jnp.array([[True, True, False], [True, False, False], [False, False, False]])
    s, c = losses.entropy_bonus(ent, m, level="token")
    assert (float(s), float(c)) == (6.0, 3.0)
    s, c = losses.entropy_bonus(ent, m, level="action")
    assert (float(s), float(c)) == (4.0, 2.0)      # H-bar = 2 and 2 over two actions


# ----------------------------------------------------------------------------------------------
# Micro-batches: sums accumulated over uneven chunks, divided once, equal the full batch.

S, B, N, K, D = 2, 7, 2, 5, 3
SPLITS = [(0, 1), (1, 4), (4, 7)]          # uneven micro-batches of rows: 1, 3, 3


def _data(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, K + 1, size=(S, B, N))
    lengths[:, 2] = 0                                                  # a row with nothing valid
    mask = np.arange(K) < lengths[..., None]
    feats = rng.normal(size=(S, B, N, K, D)).astype(np.float32)
    lp_old = (-rng.random((S, B, N, K))).astype(np.float32)
    return dict(mask=mask, feats=feats, lp_old=lp_old,
                adv_tok=rng.normal(size=(S, B, N, K)).astype(np.float32),
                adv_act=rng.normal(size=(S, B, N)).astype(np.float32),
                words=rng.integers(0, 5, size=(S, B, N)),
                v_old=rng.normal(size=(S, B, N, K)).astype(np.float32),
                ret=rng.normal(size=(S, B, N, K)).astype(np.float32) * 3)


def _loss_fn(kind, theta, d, rows, stats):
    """Loss sums of the micro-batch ``rows`` ([B] bool): the batch with the other rows masked."""
    d = {k: jnp.asarray(v) for k, v in d.items()}
    mask = jnp.logical_and(d["mask"], rows[None, :, None, None])
    feats, lp_old = d["feats"], d["lp_old"]
    lp_new = lp_old + 0.3 * jnp.tanh(feats @ theta)                     # a differentiable policy
    ent = jnp.abs(feats[..., 0] * theta[1])
    if kind == "appo":
        adv = losses.normalize_advantages(d["adv_act"], jnp.any(mask, -1), stats=stats["act"])
        return losses.appo_policy_loss(lp_new, lp_old, mask, adv, norm="word",
                                       word_count=d["words"], entropy=ent, ent_coef=0.01)
    if kind == "tppo":
        adv = losses.normalize_advantages(d["adv_tok"], mask, stats=stats["tok"])
        return losses.tppo_policy_loss(lp_new, lp_old, mask, adv, entropy=ent, ent_coef=0.01)
    value = d["v_old"] + feats @ theta
    return losses.value_loss(value, d["v_old"], d["ret"], mask, clip_eps=0.2)


def _row_mask(lo, hi):
    return jnp.asarray((np.arange(B) >= lo) & (np.arange(B) < hi))


@pytest.mark.parametrize("kind", ["appo", "tppo", "value"])
def test_micro_batches_equal_full_batch(kind):
    d = _data()
    theta = jnp.array([0.3, -0.2, 0.5])
    full_mask = jnp.asarray(d["mask"])
    stats = {"act": losses.masked_mean_std(jnp.asarray(d["adv_act"]), jnp.any(full_mask, -1)),
             "tok": losses.masked_mean_std(jnp.asarray(d["adv_tok"]), full_mask)}  # minibatch-wide
    sums_and_grad = jax.jit(jax.value_and_grad(
        lambda t, rows: (_loss_fn(kind, t, d, rows, stats).loss, _loss_fn(kind, t, d, rows, stats)),
        has_aux=True))
    mean_grad = jax.jit(jax.grad(lambda t: losses.finalize(_loss_fn(kind, t, d, _row_mask(0, B), stats))[0]))
    (_, full), _ = sums_and_grad(theta, _row_mask(0, B))
    full_loss, full_metrics = losses.finalize(full)
    full_grad = mean_grad(theta)

    acc, grad_sum = None, jnp.zeros_like(theta)
    for lo, hi in SPLITS:
        (_, part), g = sums_and_grad(theta, _row_mask(lo, hi))
        acc = part if acc is None else losses.add_sums(acc, part)
        grad_sum = grad_sum + g
    loss, metrics = losses.finalize(acc)
    assert float(acc.count) == float(full.count) > 0
    np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-5, atol=1e-7)
    for name in full_metrics:
        np.testing.assert_allclose(float(metrics[name]), float(full_metrics[name]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad_sum / acc.count), np.asarray(full_grad),
                               rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(full_grad)).max() > 0


def test_mean_of_micro_batch_means_is_not_exact():
    """Sanity check that the test above is sensitive: G1-style weighting by row share differs."""
    d = _data()
    theta = jnp.array([0.3, -0.2, 0.5])
    stats = {"tok": losses.masked_mean_std(jnp.asarray(d["adv_tok"]), jnp.asarray(d["mask"]))}
    mean = jax.jit(lambda rows: losses.finalize(_loss_fn("tppo", theta, d, rows, stats))[0])
    full = mean(_row_mask(0, B))
    g1 = sum(mean(_row_mask(lo, hi)) * (hi - lo) / B for lo, hi in SPLITS)
    assert abs(float(g1) - float(full)) > 1e-4


# ----------------------------------------------------------------------------------------------
# Update helpers.


def test_kl_early_stop_select_under_jit():
    new = {"w": jnp.ones(3), "opt": (jnp.array(2.0),)}
    old = {"w": jnp.zeros(3), "opt": (jnp.array(1.0),)}
    sel = jax.jit(lambda kl, n, o: losses.kl_early_stop_select(kl, 0.02, n, o))
    tree, skipped = sel(jnp.array(0.05), new, old)
    assert bool(skipped)
    chex_equal = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), tree, old)
    assert all(jax.tree.leaves(chex_equal))
    tree, skipped = sel(jnp.array(0.01), new, old)
    assert not bool(skipped)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), tree, new)))
    tree, skipped = losses.kl_early_stop_select(jnp.array(1e9), None, new, old)
    assert not bool(skipped) and tree is new
    # the k3 estimate itself
    s, c = losses.approx_kl_k3(jnp.log(jnp.array([1.0, 2.0, 0.5])), jnp.array([True, True, False]))
    np.testing.assert_allclose(float(s), (2 - 1 - np.log(2.0)), rtol=1e-6)
    assert float(c) == 2.0


def test_global_norm_clipping():
    tree = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
    clipped, norm = losses.clip_by_global_norm(tree, 0.5)
    assert float(norm) == pytest.approx(5.0)
    want = optax.clip_by_global_norm(0.5).update(tree, optax.EmptyState())[0]
    for k in tree:
        np.testing.assert_allclose(clipped[k], want[k], rtol=1e-6)
    same, _ = losses.clip_by_global_norm(tree, 10.0)
    np.testing.assert_array_equal(same["a"], tree["a"])
    # per agent: leaves stacked [agent, ...]; agent 0 has norm 5, agent 1 norm 0.1
    stacked = {"a": jnp.array([[3.0, 0.0], [0.06, 0.0]]), "b": jnp.array([[[4.0]], [[0.08]]])}
    clipped, norms = losses.clip_stacked_by_global_norm(stacked, 0.5)
    np.testing.assert_allclose(norms, [5.0, 0.1], rtol=1e-6)
    for a in range(2):
        one = jax.tree.map(lambda x: x[a], stacked)
        want, _ = losses.clip_by_global_norm(one, 0.5)
        for k in stacked:
            np.testing.assert_allclose(clipped[k][a], want[k], rtol=1e-6)
