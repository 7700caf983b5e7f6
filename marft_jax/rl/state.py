"""The trainable state: stacked LoRA, critic, their optimizer states, RNG and counters.

Everything trainable is float32 (the frozen base is bf16 on accelerators, float32 on CPU).
Per-agent optimizer states are stacked on the leading agent axis like the adapters, so the
agent-by-agent update can ``lax.scan`` over (adapter, optimizer state) pairs.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import optax

from marft_jax.models.config import ModelConfig
from marft_jax.models.critic import CriticParams, init_value_head
from marft_jax.models.lora import LoraConfig, LoraStack, init_lora


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Policy AdamW / critic Adam settings (reference §7 and §13)."""

    policy_lr: float = 1e-6
    critic_lr: float = 5e-5
    eps: float = 1e-5
    weight_decay: float = 0.0
    schedule: str = "constant"
    total_updates: int = 1
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.05


def _schedule(lr: float, cfg: OptimConfig):
    """Constant, or linear warm-up then cosine decay to ``min_lr_ratio · lr``."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(lr)
    total = max(cfg.total_updates, 1)
    warm = int(cfg.warmup_ratio * total)
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warm,
                                              decay_steps=max(total, warm + 1),
                                              end_value=lr * cfg.min_lr_ratio)


def policy_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """One agent's AdamW (gradient clipping happens before, per agent, in the update)."""
    return optax.adamw(_schedule(cfg.policy_lr, cfg), b1=0.9, b2=0.999, eps=cfg.eps,
                       weight_decay=cfg.weight_decay)


def critic_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    return optax.adam(_schedule(cfg.critic_lr, cfg), b1=0.9, b2=0.999, eps=cfg.eps)


@flax.struct.dataclass
class TrainState:
    """lora: ``[agent, layer, ...]`` adapters; lora_opt: AdamW states stacked on the agent axis;
    critic / critic_opt: value head (+ optional critic LoRA) and its Adam state;
    step: int32 update iterations done; rng: the run's PRNG key."""

    lora: LoraStack
    lora_opt: optax.OptState
    critic: CriticParams
    critic_opt: optax.OptState
    step: jax.Array
    rng: jax.Array


def init_train_state(key: jax.Array, cfg: ModelConfig, lora_cfg: LoraConfig, num_agents: int,
                     optim: OptimConfig, critic_lora: bool = False) -> TrainState:
    k_lora, k_head, k_clora, k_rng = jax.random.split(key, 4)
    lora = init_lora(k_lora, cfg, lora_cfg, num_agents)
    lora_opt = jax.vmap(policy_optimizer(optim).init)(lora)
    critic = CriticParams(head=init_value_head(k_head, cfg.hidden_size),
                          lora=init_lora(k_clora, cfg, lora_cfg, 1) if critic_lora else None)
    return TrainState(lora=lora, lora_opt=lora_opt, critic=critic,
                      critic_opt=critic_optimizer(optim).init(critic),
                      step=jnp.zeros((), jnp.int32), rng=k_rng)
