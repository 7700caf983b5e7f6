"""Sharded forward on 8 simulated CPU devices equals the unsharded one (run in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.xla_env import device_env

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from marft_jax.models import decoder, sharding
    from marft_jax.models.config import ModelConfig
    from marft_jax.config import LoraConfig
    from marft_jax.models.lora import init_lora
    assert len(jax.devices()) == 8, jax.devices()
    cfg = ModelConfig(arch="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
    params = decoder.init_params(jax.random.key(0), cfg, std=0.1)
    lora = init_lora(jax.random.key(1), cfg, LoraConfig(rank=4), 2)
    lora = lora.replace(b={k: 0.1 * jnp.ones_like(v) for k, v in lora.b.items()})
    tok = jax.random.randint(jax.random.key(2), (8, 12), 0, cfg.vocab_size)
    valid = jnp.arange(12)[None, :] >= jnp.array([0, 3, 5, 1, 0, 7, 2, 4])[:, None]
    agent = jnp.array([0, 1] * 4)
    want = decoder.logits_fn(params, tok, valid, cfg=cfg, lora=lora, agent=agent)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sp = sharding.shard_params(params, mesh)
    assert sp["layers"]["q_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    bs = sharding.batch_sharding(mesh, 2)
    got = decoder.logits_fn(sp, jax.device_put(tok, bs), jax.device_put(valid, bs), cfg=cfg,
                            lora=lora, agent=jax.device_put(agent, sharding.batch_sharding(mesh, 1)))
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err < 1e-4, err
    print("OK", err)
""")


def test_sharded_forward_equals_unsharded():
    env = device_env(8)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
