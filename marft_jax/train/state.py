"""Moved to :mod:`marft_jax.rl.state` (``rl/`` never imports ``train/``).

Kept only so that ``marft_jax/bench`` keeps importing while it is being edited elsewhere;
delete this module once the benchmarks import :mod:`marft_jax.rl.state`.
"""

from marft_jax.rl.state import (  # noqa: F401
    OptimConfig,
    TrainState,
    critic_optimizer,
    init_train_state,
    policy_optimizer,
)
