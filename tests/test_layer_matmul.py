"""The native decode projections (``model.decode_matmul=native``): the kernel that reads a
layer's weights in place from the stacked parameters.

References: NumPy's ``x @ w[layer]``, the decoder's cached forward with ``decode_matmul="xla"``
(with biases and per-row LoRA adapters), and the optimized HLO of a decode step (no per-layer
slice of a weight stack). The sampler's greedy tokens and log-probs and the config key:
tests/test_decode_kernels.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import cache_attention, decoder, layer_matmul
from marft_jax.models import lora as lora_lib
from marft_jax.models.config import ModelConfig
from marft_jax.sampling import buckets
from marft_jax.sampling import sampler as smp

pytestmark = pytest.mark.skipif(not layer_matmul.status().available,
                                reason=f"native kernel unavailable: {layer_matmul.status().reason}")


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 16])
@pytest.mark.parametrize("k,n", [(576, 192), (37, 1537), (1536, 576), (5, 3)])
def test_matmul_equals_numpy(rows, k, n):
    """Every row count the kernel takes, K not a multiple of its 4-row step, N not a multiple of
    a tile, more tiles than threads and fewer; the last layer of the stack (no read past it)."""
    rng = np.random.default_rng(rows * 7 + k + n)
    stack = rng.normal(size=(3, k, n)).astype(np.float32)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    for layer in (0, 2):
        got = jax.jit(layer_matmul.matmul)(jnp.asarray(x), jnp.asarray(stack), jnp.int32(layer))
        want = x.astype(np.float64) @ stack[layer].astype(np.float64)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_matmul_keeps_leading_axes_and_rejects_what_it_cannot_take():
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.normal(size=(2, 8, 5)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    got = layer_matmul.matmul(x, stack, jnp.int32(1))
    assert got.shape == (2, 3, 5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ stack[1]), atol=1e-5)
    with pytest.raises(ValueError, match="at most 16"):
        layer_matmul.matmul(jnp.zeros((17, 8), jnp.float32), stack, jnp.int32(0))
    with pytest.raises(ValueError, match="float32 stack"):
        layer_matmul.matmul(x, stack.astype(jnp.bfloat16), jnp.int32(0))
    with pytest.raises(ValueError, match=r"x \[..., K\]"):
        layer_matmul.matmul(jnp.zeros((2, 7), jnp.float32), stack, jnp.int32(0))


def _cfg(arch: str = "qwen2", **kw) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=arch == "qwen2", **kw)


@pytest.mark.parametrize("decode_attention", ["xla", "native"])
def test_cached_forward_native_equals_xla(decode_attention):
    """A prefill (more rows than the kernel takes: XLA's dot), then decode steps with per-row
    LoRA adapters on every projection: hidden states and the written cache agree."""
    if decode_attention == "native" and not cache_attention.status().available:
        pytest.skip("the native decode attention is unavailable")
    cfg = _cfg(decode_attention=decode_attention)
    ncfg = dataclasses.replace(cfg, decode_matmul="native")
    params = decoder.init_params(jax.random.key(0), cfg)
    lcfg = lora_lib.LoraConfig(rank=4, targets=list(decoder.PROJECTIONS))
    stack = lora_lib.init_lora(jax.random.key(1), cfg, lcfg, 3)
    keys = iter(jax.random.split(jax.random.key(2), 16))
    stack = stack.replace(b={t: 0.3 * jax.random.normal(next(keys), v.shape) for t, v in stack.b.items()})
    agents = jnp.asarray([0, 2, 1, 2])
    b, slots = 4, 32
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(1, 97, (b, 10)))
    valid = jnp.asarray(np.arange(10)[None] >= np.array([0, 3, 9, 5])[:, None])
    steps = [jnp.asarray(rng.integers(1, 97, (b, 1))) for _ in range(6)]
    outs = {}
    for c in (cfg, ncfg):
        fwd = jax.jit(lambda p, t, v, ps, ca, c=c: decoder.forward(p, t, v, cfg=c, positions=ps, cache=ca,
                                                                    lora=stack, agent=agents))
        cache = decoder.KVCache.init(c, b, slots)
        h, cache = decoder.forward(params, toks, valid, cfg=c, cache=cache, read_slots=0, lora=stack, agent=agents)
        pos = jnp.sum(valid, 1, keepdims=True).astype(jnp.int32) - 1
        hs = [h]
        for t in steps:
            pos = pos + 1
            h, cache = fwd(params, t, jnp.ones((b, 1), bool), pos, cache)
            hs.append(h)
        outs[c.decode_matmul] = (hs, cache)
    for a, n in zip(outs["xla"][0], outs["native"][0]):
        np.testing.assert_allclose(np.asarray(n), np.asarray(a), atol=1e-5)
    np.testing.assert_allclose(np.asarray(outs["native"][1].k), np.asarray(outs["xla"][1].k), atol=1e-5)


def test_native_decode_hlo_slices_no_weight_layer():
    """The optimized decode program calls the kernel and never slices a layer out of a weight
    stack (the XLA path's per-layer dynamic-slice copy of every projection)."""
    from tests import hf_tiny
    from tests.test_sampler import BUCKET, _prompts

    cfg, params = hf_tiny.to_jax(hf_tiny.tiny_hf_model("qwen2"))
    pb = buckets.pad_prompts(_prompts(cfg.vocab_size), min_length=BUCKET)
    shapes = {tuple(w["kernel"].shape[1:]) for n, w in params["layers"].items() if n in decoder.PROJECTIONS}
    pattern = re.compile(r"= f32\[(1,)?(\d+),(\d+)\]\{[^}]*\} (dynamic-)?slice\(")

    def weight_slices(c):
        st = smp.prefill(params, None, jnp.asarray(pb.tokens), jnp.asarray(pb.valid), jnp.asarray(pb.active),
                         jnp.int32(0), jnp.asarray(smp.stop_id_array([])), jax.random.key(0),
                         smp.SamplingParams.make(1.0), jnp.int32(8), jnp.int32(0), cfg=c, max_new_tokens=8)
        txt = smp.decode.lower(params, None, st, jnp.int32(-1), cfg=c).compile().as_text()
        found = [(int(m.group(2)), int(m.group(3))) for m in pattern.finditer(txt)]
        return txt, [s for s in found if s in shapes]

    txt, sliced = weight_slices(cfg)
    assert sliced and "marft_layer_matmul" not in txt          # the XLA path copies layers out
    txt, sliced = weight_slices(dataclasses.replace(cfg, decode_matmul="native"))
    assert "marft_layer_matmul" in txt and not sliced
