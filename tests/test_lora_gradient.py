"""The one-adapter LoRA product's hand-written gradient equals autodiff of ``(x A) B``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import lora as lora_lib


@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 5, 7)])
def test_shared_delta_gradient_equals_autodiff(shape):
    """Inputs of any leading axes; also inside ``jax.checkpoint`` in a scan over layers (how
    the update calls it)."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], shape)
    a = jax.random.normal(keys[1], (3, 7, 3))
    b = jax.random.normal(keys[2], (3, 3, 4))
    w = jax.random.normal(keys[3], shape[:-1] + (4,))

    def loss(fn, x, a, b):
        def layer(h, ab):
            y = fn(h, *ab)
            return jnp.tanh(h + y @ jnp.ones((4, 7)) / 4), (y * w).sum()
        h, parts = jax.lax.scan(jax.checkpoint(layer), x, (a, b))
        return parts.sum() + h.sum()

    got = jax.grad(lambda *args: loss(lora_lib.shared_delta, *args), argnums=(0, 1, 2))(x, a, b)
    want = jax.grad(lambda *args: loss(lambda h, a_, b_: (h @ a_) @ b_, *args), argnums=(0, 1, 2))(x, a, b)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lora_lib.shared_delta(x, a[0], b[0]), (x @ a[0]) @ b[0], rtol=1e-6)
