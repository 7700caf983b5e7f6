"""The bf16 path (GPU/TPU default), checked on CPU: bf16 weights and matmuls, float32 norms,
softmax, log-softmax and LoRA; its next-token distributions stay close to float32's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models import decoder, logprobs
from marft_jax.models.config import ModelConfig
from marft_jax.config import LoraConfig
from marft_jax.models.lora import init_lora

# Per-token KL(f32 || bf16) bound on the tiny random model (measured 4.0e-5 mean, 8.7e-5 max).
TINY_KL_MEAN, TINY_KL_MAX = 5e-4, 2e-3


def per_token_kl(logits_ref: jax.Array, logits: jax.Array) -> np.ndarray:
    """KL(softmax(ref) || softmax(other)) per position, float32 ``[..., T]``."""
    p = jax.nn.log_softmax(logits_ref.astype(jnp.float32), -1)
    q = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return np.asarray(jnp.sum(jnp.exp(p) * (p - q), -1))


def test_bf16_path_stays_close_to_float32():
    cfg = ModelConfig(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    params = decoder.init_params(jax.random.key(0), cfg, std=0.1)
    lora = init_lora(jax.random.key(1), cfg, LoraConfig(rank=4), 1)
    lora = lora.replace(b={k: 0.05 * jax.random.normal(jax.random.key(2), v.shape) for k, v in lora.b.items()})
    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, cfg.vocab_size)
    valid = jnp.arange(40)[None] >= jnp.array([[0], [9]])
    agent = jnp.int32(0)
    ref = decoder.logits_fn(params, tokens, valid, cfg, lora, agent)
    bf = decoder.cast_params(params, jnp.bfloat16)
    assert jax.tree.leaves(bf)[0].dtype == jnp.bfloat16
    low = decoder.logits_fn(bf, tokens, valid, cfg, lora, agent)
    kl = per_token_kl(ref, low)[np.asarray(valid)]
    assert kl.mean() < TINY_KL_MEAN and kl.max() < TINY_KL_MAX, (kl.mean(), kl.max())

    # The training forward's log-probs and entropies come out in float32 on the bf16 path.
    act = tokens[:, :8]
    lp, ent = logprobs.action_logprobs(bf, lora, agent, tokens, valid, act, jnp.ones_like(act, bool), 1.0, cfg=cfg)
    assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32
    ref_lp, _ = logprobs.action_logprobs(params, lora, agent, tokens, valid, act, jnp.ones_like(act, bool), 1.0,
                                         cfg=cfg)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=0.05)
