"""The centralized critic: the frozen base (no LoRA) + an MLP value head.

``V(h) = w3 · ReLU(W2 · ReLU(W1 · h))`` with ``W1: [H, 1024]``, ``W2: [1024, 512]``,
``w3: [512]``, no biases, float32 (docs/algorithm.md#critic). ``h`` is the last-layer hidden state
(after the final norm) of the base model *without* any actor LoRA, taken at

* action level: position ``L - 1`` of each agent's context (its last context token);
* token level: positions ``L - 1 + k`` for ``k = 0 … K-1`` (each predicts action token k),

so ``V[..., k=0]`` at token level equals the action-level value. Because the base is frozen,
those hidden states (the *features*) are computed once per rollout and the head runs on the
cache in every PPO epoch. With ``critic_lora`` the critic owns a LoRA on the base, which
invalidates the cache: features are recomputed with the adapter inside the critic loss.
"""

from __future__ import annotations


import chex
import flax.struct
import jax
import jax.numpy as jnp

from marft_jax.models import decoder
from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import LoraStack

HEAD_WIDTHS = (1024, 512)


@flax.struct.dataclass
class CriticParams:
    """Trainable critic state. ``head``: ``w1 [H, 1024]``, ``w2 [1024, 512]``, ``w3 [512]``;
    ``lora``: optional one-agent :class:`LoraStack` (leading agent axis of size 1)."""

    head: dict[str, jax.Array]
    lora: LoraStack | None = None


def init_value_head(key: jax.Array, hidden_size: int, widths=HEAD_WIDTHS) -> dict[str, jax.Array]:
    """Each layer uniform in ±1/sqrt(fan_in), as G1 (PyTorch ``nn.Linear`` default)."""
    k1, k2, k3 = jax.random.split(key, 3)
    u = lambda k, shape, fan_in: jax.random.uniform(k, shape, jnp.float32, -1.0, 1.0) / jnp.sqrt(fan_in)
    return {"w1": u(k1, (hidden_size, widths[0]), hidden_size),
            "w2": u(k2, (widths[0], widths[1]), widths[0]),
            "w3": u(k3, (widths[1],), widths[1])}


def value_head(head: dict[str, jax.Array], feats: jax.Array) -> jax.Array:
    """``[..., H] -> [...]`` float32 values."""
    x = feats.astype(jnp.float32)
    x = jax.nn.relu(x @ head["w1"])
    x = jax.nn.relu(x @ head["w2"])
    return x @ head["w3"]


def critic_features_fn(params, ctx_tokens, ctx_valid, act_tokens, act_valid, *, cfg: ModelConfig,
                       token_level: bool, lora: LoraStack | None = None, remat: bool | str = False):
    """Hidden states at the value positions of each sequence.

    Args:
      ctx_tokens, ctx_valid: ``[rows, L]`` left-padded contexts.
      act_tokens, act_valid: ``[rows, K]`` right-padded actions (only read at token level).
      lora: the critic's own adapter (``critic_lora``); None = the frozen base alone.
    Returns:
      ``[rows, H]`` (action level) or ``[rows, K, H]`` (token level), parameter dtype.
    """
    chex.assert_equal_shape([ctx_tokens, ctx_valid])
    L, K = ctx_tokens.shape[1], act_tokens.shape[1]
    if token_level:
        tokens = jnp.concatenate([ctx_tokens, act_tokens], 1)
        valid = jnp.concatenate([ctx_valid, act_valid], 1)
    else:  # the response is not an input at action level
        tokens, valid = ctx_tokens, ctx_valid
    agent = None if lora is None else jnp.zeros((), jnp.int32)
    hidden, _ = decoder.forward(params, tokens, valid, cfg=cfg, lora=lora, agent=agent, remat=remat)
    if token_level:
        return jax.lax.dynamic_slice_in_dim(hidden, L - 1, K, axis=1)
    return hidden[:, L - 1]


# critic_features_fn compiled on its own, on padded rows (a trajectory's features are computed packed).
padded_critic_features = jax.jit(critic_features_fn, static_argnames=("cfg", "token_level", "remat"))
