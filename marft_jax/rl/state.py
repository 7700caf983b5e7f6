"""The trainable state: stacked LoRA, critic, their optimizer states, RNG and counters.

Everything trainable is float32 (the frozen base is bf16 on accelerators, float32 on CPU).
Per-agent optimizer states are stacked on the leading agent axis like the adapters, so the
agent-by-agent update can ``lax.scan`` over (adapter, optimizer state) pairs.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax

from marft_jax.config import LoraConfig, OptimConfig
from marft_jax.models.config import ModelConfig
from marft_jax.models.critic import CriticParams, init_value_head
from marft_jax.models.lora import LoraStack, init_lora


def _schedule(lr: float, cfg: OptimConfig, total_updates: int):
    """Constant, or linear warm-up then cosine decay to ``min_lr_ratio · lr`` over ``total_updates``."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(lr)
    total = max(total_updates, 1)
    warm = int(cfg.warmup_ratio * total)
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warm,
                                              decay_steps=max(total, warm + 1),
                                              end_value=lr * cfg.min_lr_ratio)


def policy_optimizer(cfg: OptimConfig, total_updates: int = 1) -> optax.GradientTransformation:
    """One agent's AdamW (gradient clipping happens before, per agent, in the update);
    ``total_updates``: the run's optimizer steps, the length of the cosine schedule."""
    return optax.adamw(_schedule(cfg.policy_lr, cfg, total_updates), b1=0.9, b2=0.999, eps=cfg.eps,
                       weight_decay=cfg.weight_decay)


def critic_optimizer(cfg: OptimConfig, total_updates: int = 1) -> optax.GradientTransformation:
    return optax.adam(_schedule(cfg.critic_lr, cfg, total_updates), b1=0.9, b2=0.999, eps=cfg.eps)


@flax.struct.dataclass
class TrainState:
    """lora: ``[agent, layer, ...]`` adapters; lora_opt: AdamW states stacked on the agent axis;
    critic / critic_opt: value head (+ optional critic LoRA) and its Adam state, both None for a
    critic-free advantage estimator (``algo.advantage=group``: no critic parameters or memory);
    step: int32 update iterations done; rng: the run's PRNG key."""

    lora: LoraStack
    lora_opt: optax.OptState
    critic: CriticParams | None
    critic_opt: optax.OptState | None
    step: jax.Array
    rng: jax.Array


def init_train_state(key: jax.Array, cfg: ModelConfig, lora_cfg: LoraConfig, num_agents: int,
                     optim: OptimConfig, critic_lora: bool = False, critic: bool = True) -> TrainState:
    """A fresh state (the optimizer states do not depend on the schedule's length). ``critic``:
    False for a critic-free estimator (``rl.advantages.needs_critic``); the keys are split the
    same either way, so the adapters start equal."""
    k_lora, k_head, k_clora, k_rng = jax.random.split(key, 4)
    lora = init_lora(k_lora, cfg, lora_cfg, num_agents)
    lora_opt = jax.vmap(policy_optimizer(optim).init)(lora)
    value = critic_opt = None
    if critic:
        value = CriticParams(head=init_value_head(k_head, cfg.hidden_size),
                             lora=init_lora(k_clora, cfg, lora_cfg, 1) if critic_lora else None)
        critic_opt = critic_optimizer(optim).init(value)
    return TrainState(lora=lora, lora_opt=lora_opt, critic=value, critic_opt=critic_opt,
                      step=jnp.zeros((), jnp.int32), rng=k_rng)
