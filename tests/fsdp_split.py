"""Under ``mesh.fsdp`` each device keeps its rows of the activations and gathers the weights:
run by tests/test_fsdp_split.py in a subprocess with D simulated CPU devices.

``python -m tests.fsdp_split`` prints one JSON line: per mesh (one device, ``(D, 1, 1)``,
``(1, D, 1)``) the compiled temporaries per device and the all-reduces of the decoder forward
and of its LoRA gradient (remat, as the update), the sampler prefill's cache shard shape, and the
largest difference of the results from one device's.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from marft_jax.config import LoraConfig  # noqa: E402
from marft_jax.models import decoder, lora as lora_lib, sharding  # noqa: E402
from marft_jax.models.config import ModelConfig  # noqa: E402
from marft_jax.sampling import sampler as sampler_lib  # noqa: E402
from marft_jax.models.placement import Placement  # noqa: E402

CFG = ModelConfig(arch="llama", vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32)
ROWS, T = 16, 64


def _all_reduces(compiled) -> list[str]:
    """Shapes of the program's all-reduces (``f32[16,64,128]``, ...)."""
    return re.findall(r"= \(?([a-z0-9]+\[[0-9,]*\])[^=]*? all-reduce\(", compiled.as_text())


def _program(fn, *args) -> dict:
    compiled = jax.jit(fn).lower(*args).compile()
    return {"temp": int(compiled.memory_analysis().temp_size_in_bytes), "all_reduces": _all_reduces(compiled)}


def run() -> dict:
    d = jax.device_count()
    rng = np.random.default_rng(0)
    base0 = decoder.init_params(jax.random.key(0), CFG)
    lora0 = lora_lib.init_lora(jax.random.key(1), CFG, LoraConfig(rank=4), 1)
    lora0 = lora0.replace(b={k: jnp.full_like(v, 0.01) for k, v in lora0.b.items()})
    lengths = rng.integers(T // 2, T + 1, ROWS)
    tokens0 = rng.integers(2, CFG.vocab_size, (ROWS, T)).astype(np.int32)
    valid0 = np.arange(T)[None] >= (T - lengths)[:, None]                   # left-padded

    def forward(base, lora, tokens, valid):
        return decoder.forward(base, tokens, valid, cfg=CFG, lora=lora, agent=0)[0]

    def loss(lora, base, tokens, valid):
        h = decoder.forward(base, tokens, valid, cfg=CFG, lora=lora, agent=0, remat=True)[0]
        return jnp.sum(jnp.where(valid[..., None], h, 0.0) ** 2) / ROWS

    meshes = {"1_device": sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
              "data": sharding.make_mesh(d, 1, 1), "fsdp": sharding.make_mesh(1, d, 1)}
    out, results = {}, {}
    prompts = [tokens0[r, T - n:].tolist() for r, n in enumerate(lengths)]
    for label, mesh in meshes.items():
        p = Placement(mesh)
        base, lora = p.base(base0), p.replicate(lora0)
        tokens, valid = p.rows(tokens0), p.rows(valid0)
        with jax.set_mesh(mesh):
            grad = jax.grad(loss)
            out[label] = {"forward": _program(forward, base, lora, tokens, valid),
                          "grad": _program(grad, lora, base, tokens, valid)}
            h = jax.jit(forward)(base, lora, tokens, valid)
            g = jax.jit(grad)(lora, base, tokens, valid)
        smp = sampler_lib.Sampler(CFG, pad_id=0)
        smp.place_on(p)
        res = smp(base, prompts, key=jax.random.key(3), lora=lora, agent=0,
                  config=sampler_lib.SamplingConfig(max_new_tokens=8, temperature=0.0))
        results[label] = (h, g, res.tokens)
    one = results["1_device"]
    out["max_abs_diff"] = max(_diff(one[i], results[m][i]) for m in ("data", "fsdp") for i in (0, 1))
    out["tokens_equal"] = all(np.array_equal(np.asarray(one[2]), np.asarray(results[m][2])) for m in ("data", "fsdp"))
    return out


def _diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(sharding.to_host(a)), jax.tree.leaves(sharding.to_host(b)))
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
               for x, y in pairs)


if __name__ == "__main__":
    print(json.dumps(dict(run(), devices=jax.device_count())))
