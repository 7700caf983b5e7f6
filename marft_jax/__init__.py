"""marft_jax: Multi-Agent Reinforcement Fine-Tuning (MARFT) in JAX.

A team of LLM agents acts in sequence; each agent is a LoRA adapter on one shared frozen
base model, a centralized critic scores every decision point, and PPO updates the agents
one after another. See README.md and docs/.
"""

__version__ = "0.1.0"
