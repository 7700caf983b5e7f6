"""Attention implementations (models/attention.py): each one available on CPU matches XLA."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import attention, decoder
from marft_jax.models.config import ModelConfig


def _inputs(b=2, t=128, heads=4, kv=2, d=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, heads, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, kv, t, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, kv, t, d), jnp.float32)
    seg = np.zeros((b, t), np.int32)       # row 0: three segments and padding; row 1: one, left-padded
    seg[0, :40], seg[0, 40:90], seg[0, 90:120] = 1, 2, 3
    seg[1, 17:] = 1
    return q, k, v, jnp.asarray(seg)


def _naive(q, k, v, seg):
    """A loop over rows, heads and segments (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    seg = np.asarray(seg)
    b, t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for s in set(seg[r].tolist()) - {0}:
            idx = np.flatnonzero(seg[r] == s)
            for head in range(h):
                sc = q[r, idx, head] @ k[r, head // g, idx].T / np.sqrt(d)
                sc = np.where(np.tril(np.ones((len(idx), len(idx)), bool)), sc, -np.inf)
                p = np.exp(sc - sc.max(-1, keepdims=True))
                out[r, idx, head] = (p / p.sum(-1, keepdims=True)) @ v[r, head // g, idx]
    return out


def test_xla_segment_attention_matches_a_loop():
    q, k, v, seg = _inputs()
    out = attention.segment_attention(q, k, v, seg, impl="xla")
    valid = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(out)[valid], _naive(q, k, v, seg)[valid], atol=1e-5)


@pytest.mark.parametrize("impl", ["cudnn:xla", "pallas:interpret", "splash:interpret"])
def test_implementations_available_on_cpu_match_xla(impl):
    """cudnn's layout and mask conversion (through jax.nn.dot_product_attention's XLA path), the
    Pallas GPU flash kernel and TPU splash attention in interpret mode; float32, valid positions."""
    q, k, v, seg = _inputs()
    ref = np.asarray(attention.segment_attention(q, k, v, seg, impl="xla"))
    try:
        out = np.asarray(jax.jit(lambda *a: attention.segment_attention(*a, impl=impl))(q, k, v, seg))
    except NotImplementedError as e:   # pragma: no cover - depends on the installed jax
        pytest.skip(f"{impl} does not run on this jax: {e}")
    valid = np.asarray(seg) > 0
    np.testing.assert_allclose(out[valid], ref[valid], atol=1e-5)


def test_decoder_with_another_implementation_equals_xla():
    cfg = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = decoder.init_params(jax.random.key(0), cfg, std=0.3)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 61)
    valid = jnp.arange(24)[None] >= jnp.array([[0], [5]])
    ref, _ = decoder.forward(params, tokens, valid, cfg=cfg)
    other, _ = jax.jit(lambda p, t, m: decoder.forward(p, t, m, cfg=dataclasses.replace(cfg, attention="cudnn:xla")))(
        params, tokens, valid)
    np.testing.assert_allclose(np.asarray(other)[np.asarray(valid)], np.asarray(ref)[np.asarray(valid)], atol=1e-5)


def test_resolve_picks_per_backend_and_names_the_key():
    assert attention.resolve("auto", "cpu") == "xla"
    assert attention.resolve("auto", "gpu", jnp.bfloat16) == "cudnn"
    assert attention.resolve("auto", "cuda", jnp.float32) == "xla"     # cuDNN flash attention is half precision
    assert attention.resolve("auto", "tpu", jnp.bfloat16) == "splash"
    assert attention.resolve("pallas", "tpu") == "pallas"
    with pytest.raises(attention.AttentionUnavailable, match=r"model.attention='cudnn' needs a GPU backend.*'cpu'"):
        attention.resolve("cudnn", "cpu")
    with pytest.raises(attention.AttentionUnavailable, match="model.attention='splash'"):
        attention.resolve("splash", "gpu")
    with pytest.raises(attention.AttentionUnavailable, match="is not one of"):
        attention.resolve("flash", "cpu")


def test_config_rejects_an_implementation_the_backend_lacks(tmp_path):
    from marft_jax.config import ConfigError, load_config
    from marft_jax.train.build import build_run

    cfg = load_config("demo", ["model.attention=cudnn", f"train.out_dir={tmp_path}"])
    if jax.default_backend() != "cpu":   # pragma: no cover
        pytest.skip("checks the CPU backend")
    with pytest.raises(ConfigError, match="model.attention='cudnn'"):
        build_run(cfg)
    with pytest.raises(ConfigError, match="model.attention"):
        load_config("demo", ["model.attention=flash"])


@pytest.mark.parametrize("t", [64, 130, 200])
def test_blocked_causal_path_equals_the_dense_one_with_gradients(t):
    """causal=True skips the score blocks above the diagonal (query blocks of 64, the last one
    partial at t=130/200); values and gradients equal the dense masked path's."""
    q, k, v, _ = _inputs(t=t)
    seg = np.zeros((2, t), np.int32)
    seg[0, :t // 3], seg[0, t // 3:t - 5] = 1, 2                      # two segments, right padding
    seg[1, 11:] = 1                                                   # left padding
    mask = attention.segment_mask(jnp.asarray(seg))

    def loss(q, k, v, causal):
        out = attention.xla_attention(q, k, v, mask, causal=causal)
        return jnp.sum(jnp.where(jnp.asarray(seg > 0)[..., None, None], out, 0.0) ** 2), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, dense), g_dense = grad(q, k, v, False)
    (_, blocked), g_blocked = grad(q, k, v, True)
    valid = seg > 0
    np.testing.assert_allclose(np.asarray(blocked)[valid], np.asarray(dense)[valid], atol=1e-5)
    for a, b in zip(g_blocked, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    assert attention.causal_block_size(t) == 64 and attention.causal_block_size(4096) == 128
