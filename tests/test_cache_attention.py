"""The native decode attention (``model.decode_attention=native``): the kernel that reads the
stacked KV cache in place.

References: :func:`marft_jax.models.attention.xla_attention` with a prefix (the XLA path), the
decoder's cached forward with ``decode_attention="xla"``, HF greedy ``generate``, and the
optimized HLO (no per-layer slice of the cache). The sampler's greedy tokens and log-probs and
the config key: tests/test_decode_kernels.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import attention as attention_lib
from marft_jax.models import cache_attention, decoder
from marft_jax.models.config import ModelConfig
from marft_jax.sampling import buckets
from marft_jax.sampling import sampler as smp

pytestmark = pytest.mark.skipif(not cache_attention.status().available,
                                reason=f"native kernel unavailable: {cache_attention.status().reason}")


def _cfg(head_dim: int, **kw) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=101, hidden_size=2 * head_dim, intermediate_size=48,
                       num_layers=3, num_heads=4, num_kv_heads=2, head_dim=head_dim, **kw)


@pytest.mark.parametrize("head_dim,t,read", [(64, 1, 40), (128, 1, 17), (16, 3, 40), (24, 2, 9)])
def test_attend_equals_xla_attention_with_prefix(head_dim, t, read):
    """One layer of the stack, masked slots (including a row with none readable), a masked new
    key, T > 1 causal new tokens, P < slots and head sizes with and without a fast path."""
    rng = np.random.default_rng(head_dim + t)
    b, nh, nkv, layers, slots = 3, 4, 2, 3, 40
    q = jnp.asarray(rng.normal(size=(b, t, nh, head_dim)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(b, nkv, t, head_dim)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(b, nkv, t, head_dim)), jnp.float32)
    kc = jnp.asarray(rng.normal(size=(layers, b, nkv, slots, head_dim)) * 2, jnp.float32)
    vc = jnp.asarray(rng.normal(size=(layers, b, nkv, slots, head_dim)), jnp.float32)
    ok = rng.random((b, read)) > 0.3
    ok[2] = False                                                  # nothing cached is readable
    new_valid = np.ones((b, t), bool)
    new_valid[1, 0] = False
    new_mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & new_valid[:, None, :])
    layer = 1
    got = jax.jit(cache_attention.attend)(q, k_new, v_new, new_mask, kc, vc, jnp.int32(layer), jnp.asarray(ok))
    prefix = (kc[layer, :, :, :read], vc[layer, :, :, :read], jnp.broadcast_to(jnp.asarray(ok)[:, None], (b, t, read)))
    want = attention_lib.xla_attention(q, k_new, v_new, new_mask, prefix, causal=True)
    assert got.shape == want.shape == (b, t, nh, head_dim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_cached_forward_native_equals_xla():
    """Prefill into an empty cache, a 3-token prefill into the filled cache (one masked token)
    and five decode steps: hidden states and the written cache agree with the XLA path."""
    cfg = _cfg(64)
    ncfg = dataclasses.replace(cfg, decode_attention="native")
    params = decoder.init_params(jax.random.key(0), cfg)
    b, slots = 3, 40
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(1, 101, (b, 12)))
    valid = jnp.asarray(np.arange(12)[None] >= np.array([0, 3, 11])[:, None])
    steps = [(jnp.asarray(rng.integers(1, 101, (b, 3))), jnp.ones((b, 3), bool).at[1, 0].set(False), 24)]
    steps += [(jnp.asarray(rng.integers(1, 101, (b, 1))), jnp.ones((b, 1), bool), slots) for _ in range(5)]
    outs = {}
    for c in (cfg, ncfg):
        fwd = jax.jit(lambda p, t, v, ps, ca, c=c, read=None: decoder.forward(
            p, t, v, cfg=c, positions=ps, cache=ca, read_slots=read), static_argnames=("read",))
        cache = decoder.KVCache.init(c, b, slots)
        h, cache = decoder.forward(params, toks, valid, cfg=c, cache=cache, read_slots=0)
        pos = jnp.sum(valid, 1, keepdims=True).astype(jnp.int32) - 1
        hs = [h]
        for t, v, read in steps:
            ps = pos + jnp.cumsum(v, 1).astype(jnp.int32)
            h, cache = fwd(params, t, v, ps, cache, read=read)
            hs.append(h)
            pos = ps[:, -1:]
        outs[c.decode_attention] = (hs, cache)
    for a, n in zip(outs["xla"][0], outs["native"][0]):
        np.testing.assert_allclose(np.asarray(n), np.asarray(a), atol=1e-5)
    np.testing.assert_allclose(np.asarray(outs["native"][1].k), np.asarray(outs["xla"][1].k), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(outs["native"][1].valid), np.asarray(outs["xla"][1].valid))


def test_native_decode_hlo_slices_no_cache_layer():
    """The optimized decode program never slices a layer out of the cache stack (the XLA
    path's per-layer dynamic-slice copy) and still writes the stack in place."""
    from tests import hf_tiny
    from tests.test_sampler import BUCKET, _prompts

    cfg, params = hf_tiny.to_jax(hf_tiny.tiny_hf_model("qwen2"))
    cfg = dataclasses.replace(cfg, decode_attention="native")
    pb = buckets.pad_prompts(_prompts(cfg.vocab_size), min_length=BUCKET)
    st = smp.prefill(params, None, jnp.asarray(pb.tokens), jnp.asarray(pb.valid), jnp.asarray(pb.active),
                     jnp.int32(0), jnp.asarray(smp.stop_id_array([])), jax.random.key(0),
                     smp.SamplingParams.make(1.0), jnp.int32(8), jnp.int32(0), cfg=cfg, max_new_tokens=8)
    txt = smp.decode.lower(params, None, st, jnp.int32(-1), cfg=cfg).compile().as_text()
    layers, b, kv, slots, d = st.cache.k.shape
    assert "marft_cache_attention" in txt
    layer_slice = re.compile(r"= f32\[1?,?%d,%d,%d,%d\]\{[^}]*\} dynamic-slice\(" % (b, kv, slots, d))
    assert not layer_slice.search(txt)
    stack = "f32[%d,%d,%d,%d,%d]" % st.cache.k.shape
    producers = [line for line in txt.splitlines() if re.match(r"\s*(ROOT )?%\S+ = " + re.escape(stack) + r"\{", line)]
    assert not any(re.search(r"\} copy\(", line) for line in producers)
