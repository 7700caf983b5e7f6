"""What the native decode kernels share, ``model.decode_attention``
(:mod:`marft_jax.models.cache_attention`) and ``model.decode_matmul``
(:mod:`marft_jax.models.layer_matmul`): the sampler's greedy tokens and log-probs equal the XLA
path's with either, both keys resolve through :func:`marft_jax.native_build.resolve_cpu_kernel`,
and a bad value is an error naming the key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.config import ConfigError, load_config
from marft_jax.models import cache_attention, layer_matmul
from marft_jax.models.config import ModelConfig
from marft_jax.sampling import sampler as smp

KERNELS = [pytest.param(cache_attention, "decode_attention", id="decode_attention"),
           pytest.param(layer_matmul, "decode_matmul", id="decode_matmul")]


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=101, hidden_size=128, intermediate_size=48,
                       num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64, **kw)


def _need(module) -> None:
    """Skip where the kernel does not build (the check also registers its FFI target)."""
    if not module.status().available:
        pytest.skip(f"native kernel unavailable: {module.status().reason}")


@pytest.mark.parametrize("module,field", KERNELS)
def test_sampler_greedy_tokens_and_logps_native_equal_xla(module, field):
    from tests import hf_tiny
    from tests.test_sampler import _prompts

    _need(module)
    cfg, params = hf_tiny.to_jax(hf_tiny.tiny_hf_model("qwen2"))
    prompts = _prompts(cfg.vocab_size)
    conf = smp.SamplingConfig(max_new_tokens=40, temperature=0.0)
    outs = [smp.Sampler(c, pad_id=0)(params, prompts, key=jax.random.key(0), config=conf)
            for c in (cfg, dataclasses.replace(cfg, **{field: "native"}))]
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_allclose(outs[1].logps, outs[0].logps, atol=1e-5)


@pytest.mark.parametrize("module,field", KERNELS)
def test_resolve(module, field):
    _need(module)
    key = f"model.{field}"
    assert module.resolve("xla") == "xla"
    assert module.resolve("auto", backend="cpu", dtype=jnp.float32, devices=1) == "native"
    assert module.resolve("native", backend="cpu", dtype=jnp.float32, devices=1) == "native"
    assert module.resolve("auto", backend="cpu", dtype=jnp.bfloat16, devices=1) == "xla"
    assert module.resolve("auto", backend="cpu", dtype=jnp.float32, devices=8) == "xla"
    assert module.resolve("auto", backend="gpu", dtype=jnp.float32, devices=1) == "xla"
    with pytest.raises(ValueError, match=rf"{key}=native needs float32"):
        module.resolve("native", backend="cpu", dtype=jnp.bfloat16, devices=1)
    with pytest.raises(ValueError, match=rf"{key}=native runs on one device"):
        module.resolve("native", backend="cpu", dtype=jnp.float32, devices=2)
    with pytest.raises(ValueError, match=rf"{key}='flash' is not one of"):
        module.resolve("flash")
    with pytest.raises(ValueError, match=field):
        _cfg(**{field: "auto"})


@pytest.mark.parametrize("field", ["decode_attention", "decode_matmul"])
def test_config_key_is_validated(field):
    with pytest.raises(ConfigError, match=f"model.{field}"):
        load_config(None, [f"model.{field}=flash"])
