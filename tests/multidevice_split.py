"""Whether each device does its 1/D share of a stage: run by tests/test_multidevice_split.py in
a subprocess with D simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``).

Usage: ``python -m tests.multidevice_split CHECK``, CHECK one of :data:`CHECKS`. The last stdout
line is one JSON object: the per-device compiled FLOPs on ``devices[:1]`` and on a data-only mesh
of all D (``flops_1_device``, ``flops_per_device``), the output shardings where the check is
about placement, and the largest difference between the two runs' results (``max_abs_diff``).
The model is a tiny random decoder, the inputs random tokens with ragged lengths.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from marft_jax.models import decoder, sharding  # noqa: E402
from marft_jax.models.config import ModelConfig  # noqa: E402
from marft_jax.models.placement import Placement  # noqa: E402

CFG = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
ROWS, AGENTS, CTX, ACT = 16, 2, 48, 16


def _meshes() -> dict:
    return {"1_device": sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
            "mesh": sharding.make_mesh(-1, 1, 1)}


def _flops(compiled) -> float:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0))


def _max_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(sharding.to_host(a)), jax.tree.leaves(sharding.to_host(b)))
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
               for x, y in pairs)


def _trajectory():
    from marft_jax.bench.scaling import _random_trajectory

    return _random_trajectory(np.random.default_rng(0), CFG.vocab_size, S=1, B=ROWS, N=AGENTS, L=CTX, K=ACT)


def micro_batched_update(packed: bool) -> dict:
    """ppo_update with as many micro-batches as devices (the worst case: before the split, each
    micro-batch lived on one device and the scan gathered it to all)."""
    from marft_jax.config import LoraConfig, OptimConfig, PPOConfig
    from marft_jax.rl import packing
    from marft_jax.rl.state import init_train_state
    from marft_jax.rl.update import UpdateBatch, UpdateConfig, ppo_update

    D = jax.device_count()
    traj = _trajectory()
    rng = np.random.default_rng(1)
    shape3 = (1, ROWS, AGENTS)
    batch = UpdateBatch(ctx_tokens=traj.ctx_tokens, ctx_valid=traj.ctx_valid, act_tokens=traj.act_tokens,
                        act_valid=traj.act_valid, logp_old=np.where(traj.act_valid, -1.0, 0.0).astype(np.float32),
                        adv=rng.standard_normal(shape3).astype(np.float32),
                        ret=rng.standard_normal(shape3).astype(np.float32),
                        v_old=rng.standard_normal(shape3).astype(np.float32), dp_mask=np.ones(shape3, bool),
                        feats=rng.standard_normal(shape3 + (CFG.hidden_size,)).astype(np.float32),
                        word_count=np.ones(shape3, np.int32))
    ucfg = UpdateConfig(ppo=PPOConfig(micro_batches=D, kl_stop=None), optim=OptimConfig(policy_lr=1e-2))
    state0 = init_train_state(jax.random.key(1), CFG, LoraConfig(rank=4), AGENTS, ucfg.optim)
    # LoRA b starts at zero: perturb it so the policy (and its gradient) depends on both factors.
    state0 = state0.replace(lora=jax.tree.map(lambda x: x + 0.01, state0.lora))
    packed = None
    if packed:
        perms = packing.minibatch_perms(state0.rng, ROWS, ucfg.ppo.num_minibatches, ucfg.ppo.epochs)
        # The same packed shape on both meshes (rows a multiple of D): only the placement differs.
        packed, _ = packing.pack_update(traj.ctx_tokens, traj.ctx_valid, traj.act_tokens, traj.act_valid, perms,
                                      micro_batches=D, policy=packing.ShapePolicy(row_multiple=D))
        batch = batch.replace(ctx_tokens=None, ctx_valid=None)
    base0 = decoder.init_params(jax.random.key(0), CFG)
    out: dict = {}
    results = {}
    for label, mesh in _meshes().items():
        p = Placement(mesh)
        base, state = p.base(base0), p.replicate(jax.tree.map(jnp.array, state0))
        b = p.tree_rows(batch, 1)
        pl = None if packed is None else packed.replace(
            perms=p.replicate(packed.perms), gather=p.replicate(packed.gather),
            rows=p.tree_rows(packed.rows, packing.UPDATE_ROWS_AXIS))
        mask, flag = p.replicate(np.ones(AGENTS, bool)), p.replicate(np.asarray(True))
        with jax.set_mesh(mesh):
            compiled = ppo_update.lower(base, state, b, mask, flag, cfg=CFG, ucfg=ucfg, packed=pl).compile()
            out[f"flops_{label}"] = _flops(compiled)
            new, metrics = compiled(base, state, b, mask, flag, packed=pl)
        results[label] = (new.lora, new.critic, metrics)
    out["flops_per_device"] = out.pop("flops_mesh")
    out["max_abs_diff"] = _max_diff(results["1_device"], results["mesh"])
    out["changed"] = _max_diff(results["1_device"][0], state0.lora)
    return out


def sampler_resize() -> dict:
    """A greedy sampler call long enough for two decode phases (16-token prompts, 64 new tokens) (the cache grows in ``resize``
    between them) on one device, a data-only mesh and a (D/2, 1, 2) mesh: the resized cache's
    sharding, the per-device FLOPs of the decode program that follows it, and the tokens."""
    from marft_jax.sampling import sampler as sampler_lib

    D = jax.device_count()
    base0 = decoder.init_params(jax.random.key(0), CFG)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, CFG.vocab_size, rng.integers(4, 16)).tolist() for _ in range(2 * D)]
    resized: list = []
    resize = sampler_lib.resize

    def spy(state, rows, keep, *, slots, compact=True):
        hlo = resize.lower(state, rows, keep, slots=slots, compact=compact).compile().as_text()
        out = resize(state, rows, keep, slots=slots, compact=compact)
        flops = None if label == "tensor" else _flops(sampler_lib.decode.lower(
            base, None, out, jnp.int32(-1), cfg=CFG, top_k_max=0, use_top_p=False).compile())
        resized.append((out.cache, flops, compact, hlo.count("all-gather(")))
        return out

    sampler_lib.resize = spy
    meshes = dict(_meshes(), tensor=sharding.make_mesh(-1, 1, 2))
    out: dict = {}
    tokens = {}
    for label, mesh in meshes.items():
        p = Placement(mesh)
        base = p.base(base0)
        smp = sampler_lib.Sampler(CFG, pad_id=0)
        smp.place_on(p)
        res = smp(base, prompts, key=jax.random.key(3),
                  config=sampler_lib.SamplingConfig(max_new_tokens=64, temperature=0.0))
        assert resized, "the call never resized its cache"
        cache, flops, compact, all_gathers = resized[-1]
        out[label] = {"k_shard_shape": list(cache.k.sharding.shard_shape(cache.k.shape)),
                      "k_shape": list(cache.k.shape), "valid_shard_shape":
                      list(cache.valid.sharding.shard_shape(cache.valid.shape)), "decode_flops": flops,
                      "compacted": compact, "resize_all_gathers": all_gathers}
        tokens[label] = res.tokens
        resized.clear()
    out["flops_1_device"] = out["1_device"]["decode_flops"]
    out["flops_per_device"] = out["mesh"]["decode_flops"]
    out["max_abs_diff"] = max(_max_diff(tokens["1_device"], tokens[k]) for k in ("mesh", "tensor"))
    return out


def feature_gather() -> dict:
    """The critic feature pass in several calls of packed rows (lax.map over calls, rows split
    over the data shards), read at the decision points: the [call, row, slot] states flattened
    end to end were not split contiguously, and XLA all-gathered every hidden state onto every
    device before the gather. Reports the all-gathers in the partitioned program, the largest
    temporaries and the per-device FLOPs."""
    from marft_jax.rl import packing
    from marft_jax.train import prepare

    base0 = decoder.init_params(jax.random.key(0), CFG)
    traj = _trajectory()
    out, hidden = {}, {}
    for label, mesh in _meshes().items():
        placement = Placement(mesh)
        calls, gather, _, _ = prepare.feature_inputs(
            traj, token_level=False, tokens_per_call=4 * (CTX + ACT),        # several calls per class
            policy=packing.ShapePolicy(row_multiple=placement.row_shards), placement=placement)
        base = placement.base(base0)
        compiled = prepare._packed_hidden_at.lower(base, None, calls, gather, cfg=CFG).compile()
        text = compiled.as_text()
        out[label] = {"calls": [list(c.tokens.shape) for c in calls], "flops": _flops(compiled),
                      "all_gathers": sum(1 for line in text.splitlines() if " all-gather(" in line),
                      "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
        hidden[label] = prepare._packed_hidden_at(base, None, calls, gather, cfg=CFG)
    out["flops_1_device"] = out["1_device"]["flops"]
    out["flops_per_device"] = out["mesh"]["flops"]
    out["max_abs_diff"] = _max_diff(hidden["1_device"], hidden["mesh"])
    return out


CHECKS = {
    "feature_gather": feature_gather,
    "update_micro_padded": lambda: micro_batched_update(packed=False),
    "update_micro_packed": lambda: micro_batched_update(packed=True),
    "sampler_resize": sampler_resize,
}


if __name__ == "__main__":
    report = CHECKS[sys.argv[1]]()
    print(json.dumps(dict(report, devices=jax.device_count())))
