"""Chunked training-side log-probs equal the full-logits computation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import decoder, logprobs
from marft_jax.models.config import ModelConfig
from marft_jax.config import LoraConfig
from marft_jax.models.lora import init_lora


def _cfg():
    return ModelConfig(arch="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_chunked_matches_full(chunk, temp):
    cfg = _cfg()
    params = decoder.init_params(jax.random.key(0), cfg, std=0.2)
    lora = init_lora(jax.random.key(1), cfg, LoraConfig(rank=4), 2)
    lora = lora.replace(b={k: 0.1 * jax.random.normal(jax.random.key(2), v.shape) for k, v in lora.b.items()})
    rng = np.random.default_rng(0)
    B, L, K = 3, 6, 7
    ctx_len, act_len = np.array([6, 2, 4]), np.array([7, 0, 3])
    ctx = rng.integers(0, cfg.vocab_size, (B, L)).astype(np.int32)
    ctx_valid = np.arange(L)[None] >= (L - ctx_len)[:, None]
    act = rng.integers(0, cfg.vocab_size, (B, K)).astype(np.int32)
    act_valid = np.arange(K)[None] < act_len[:, None]
    agent = jnp.array([0, 1, 1])
    logp, ent = logprobs.action_logprobs(params, lora, agent, ctx, ctx_valid, act, act_valid,
                                         temp, cfg=cfg, chunk=chunk)
    full = decoder.logits_fn(params, jnp.concatenate([ctx, act], 1),
                             jnp.concatenate([ctx_valid, act_valid], 1), cfg=cfg, lora=lora, agent=agent)
    z = np.asarray(full[:, L - 1:L - 1 + K]) / temp
    lsm = z - jax.scipy.special.logsumexp(z, -1, keepdims=True)
    want = np.take_along_axis(np.asarray(lsm), act[..., None], -1)[..., 0]
    want_ent = -(np.exp(lsm) * lsm).sum(-1)
    np.testing.assert_allclose(np.asarray(logp)[act_valid], want[act_valid], atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[act_valid], np.asarray(want_ent)[act_valid], atol=1e-5)
    assert np.all(np.asarray(logp)[~act_valid] == 0)


def test_gradient_through_chunks_matches_full():
    cfg = _cfg()
    params = decoder.init_params(jax.random.key(0), cfg, std=0.2)
    hidden = jax.random.normal(jax.random.key(3), (2, 9, cfg.hidden_size))
    tgt = jax.random.randint(jax.random.key(4), (2, 9), 0, cfg.vocab_size)
    head = decoder.lm_head(params, cfg)

    def chunked(h):
        lp, ent = logprobs.chunked_logprobs(h, head, tgt, 1.0, chunk=4)
        return lp.sum() + 0.1 * ent.sum()

    def full(h):
        z = h @ head
        lsm = jax.nn.log_softmax(z)
        lp = jnp.take_along_axis(lsm, tgt[..., None], -1).sum()
        return lp + 0.1 * (-(jnp.exp(lsm) * lsm).sum())

    np.testing.assert_allclose(jax.grad(chunked)(hidden), jax.grad(full)(hidden), atol=1e-4)


def test_logits_chunk_is_per_backend_large_on_accelerators_and_unchanged_on_cpu(monkeypatch):
    """The CPU keeps 64 MiB chunks (its results are pinned); GPU/TPU chunks hold 1 GiB of logits
    (bounded by 1/32 of the device's memory), so the head is read a few times, not ~40."""
    assert logprobs.logits_chunk_bytes("cpu") == 64 << 20
    assert logprobs.logits_chunk_bytes("gpu", device_memory_bytes=80 << 30) == 1 << 30
    assert logprobs.logits_chunk_bytes("tpu", device_memory_bytes=16 << 30) == 512 << 20
    assert logprobs.logits_chunk_bytes("gpu", device_memory_bytes=None) >= 64 << 20
    # Qwen2.5's 151,936 vocabulary, 8 rows x 512 action tokens: scan steps = head reads.
    hidden = jax.ShapeDtypeStruct((8, 512, 64), jnp.bfloat16)
    head = jax.ShapeDtypeStruct((64, 151936), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((8, 512), jnp.int32)

    real = logprobs.logits_chunk_bytes

    def head_reads(backend):
        monkeypatch.setattr(logprobs, "logits_chunk_bytes", lambda: real(backend, device_memory_bytes=80 << 30))
        jaxpr = jax.make_jaxpr(lambda h, w, t: logprobs.chunked_logprobs(h, w, t, chunk=512))(hidden, head, targets)
        return [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]

    assert head_reads("cpu") == [-(-512 // 13)]      # 13 positions per row and chunk: 40 reads
    assert head_reads("gpu") == [3]                  # 220 positions per row and chunk


@pytest.mark.parametrize("tied", [True, False])
def test_update_gradient_keeps_the_head_in_its_stored_layout(tied):
    """A tied embedding enters the log-prob scan as stored (``[vocab, H]``): the compiled gradient
    of a scan over agents (the update's shape) holds no ``[H, vocab]`` transposed copy of it,
    which XLA:CPU otherwise materializes once per agent step (113 MB on SmolLM2-135M). The
    result equals the one through the transposed matrix."""
    cfg = dataclasses.replace(_cfg(), vocab_size=211, tie_word_embeddings=tied)
    params = decoder.init_params(jax.random.key(0), cfg, std=0.2)
    lora = init_lora(jax.random.key(1), cfg, LoraConfig(rank=4), 2)
    rng = np.random.default_rng(0)
    ctx = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 3, 6)), jnp.int32)
    act = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 3, 5)), jnp.int32)
    ones_c, ones_a = jnp.ones(ctx.shape, bool), jnp.ones(act.shape, bool)

    def loss(lora_, head_layout):
        def body(total, xs):
            i, c, a = xs
            rows = decoder.padded_rows(*logprobs.concat_context_action(c, ones_c[0], a, ones_a[0]))
            gather = jnp.arange(3, dtype=jnp.int32)[:, None] * 11 + 5 + jnp.arange(5, dtype=jnp.int32)
            flat = decoder.forward_packed(params, rows, cfg=cfg, lora=lora_, agent=i)
            head = (decoder.output_head(params, cfg) if head_layout == "stored"
                    else decoder.lm_head(params, cfg))
            lp, ent = logprobs.chunked_logprobs(jnp.take(flat, gather, axis=0), head, a, 0.7, chunk=2)
            return total + lp.sum() + 0.1 * ent.sum(), None
        return jax.lax.scan(body, 0.0, (jnp.arange(2), ctx, act))[0]

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    hlo = grad.lower(lora, "stored").compile().as_text()
    transposed = f"f32[{cfg.hidden_size},{cfg.vocab_size}]"
    if tied:
        assert transposed not in hlo, [l for l in hlo.splitlines() if transposed in l][:3]
    got, want = grad(lora, "stored"), grad(lora, "transposed")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
