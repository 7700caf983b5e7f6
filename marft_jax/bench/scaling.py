"""How the work splits over devices: per-device compiled FLOPs and bytes of the update (with one
and with ``--micro-batches`` micro-batches), the feature pass and one sampler call, on a mesh of
D simulated CPU devices against one device.

``python -m marft_jax.bench.scaling --devices 8`` (or ``marft-jax bench scaling --devices 8``)
re-runs itself in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=D`` and
compiles each stage twice in that process: on ``devices[:1]`` and on a ``(data, fsdp, tensor)``
mesh of all D, with the inputs placed as a training run places them
(:mod:`marft_jax.models.placement`). ``flops_per_device`` is XLA's ``cost_analysis`` of the
partitioned (per-device) program. The goal on a data-only mesh is ``ratio <= 1.2 / D``.

The model is a small random decoder (no download); the trajectory is random tokens with
ragged lengths, the shapes of a real rollout. The last stdout line is one JSON object::

  {"devices": D, "mesh": {...}, "stages": {name: {"flops_per_device": f, "flops_1_device": f1,
   "ratio": f / f1, "bytes_per_device": b, "bytes_1_device": b1, "bytes_ratio": b / b1,
   "temp_bytes_per_device": t, "temp_bytes_1_device": t1, "temp_ratio": t / t1}}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from typing import Sequence

CHILD_FLAG = "--_child"


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices D")
    p.add_argument("--data", type=int, default=-1, help="mesh data axis (-1: the rest)")
    p.add_argument("--fsdp", type=int, default=1)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--rows", type=int, default=64, help="problem rows B (a multiple of data x fsdp)")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--ctx", type=int, default=96, help="longest context L")
    p.add_argument("--act", type=int, default=32, help="longest response K")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="ppo.micro_batches of the stage update_micro_batches (the update stage uses 1)")
    p.add_argument("--token-level", action="store_true", help="MARFT-T (token-level values and PPO)")
    p.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args._child:
        return _spawn(args, list(argv or []))
    report = _measure(args)
    print(json.dumps(report))
    return report


def _spawn(args, argv: list[str]) -> dict:
    from marft_jax.distributed import simulated_devices_env

    env = simulated_devices_env(args.devices)
    out = subprocess.run([sys.executable, "-m", "marft_jax.bench.scaling", *argv, CHILD_FLAG], env=env,
                         capture_output=True, text=True)
    sys.stderr.write(out.stderr[-4000:])
    if out.returncode != 0:
        raise SystemExit(f"bench scaling: the {args.devices}-device subprocess failed (exit {out.returncode})")
    lines = out.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line)
    report = json.loads(lines[-1])
    print(json.dumps(report))
    return report


def _measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marft_jax.config import AlgoConfig, LoraConfig, OptimConfig, PPOConfig
    from marft_jax.models import decoder
    from marft_jax.models.config import ModelConfig
    from marft_jax.models.critic import CriticParams
    from marft_jax.rl import packing
    from marft_jax.rl.advantages import AdvantageConfig
    from marft_jax.rl.update import UpdateConfig, ppo_update
    from marft_jax.sampling import sampler as sampler_lib
    from marft_jax.train import prepare
    from marft_jax.train.iteration import TeamLearner
    from marft_jax.models.placement import Placement
    from marft_jax.rl.state import init_train_state

    if jax.device_count() != args.devices:
        raise SystemExit(f"expected {args.devices} devices, have {jax.device_count()}")
    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=16)
    base0 = decoder.init_params(jax.random.key(0), cfg)
    traj = _random_trajectory(np.random.default_rng(0), cfg.vocab_size, S=1, B=args.rows, N=args.agents,
                              L=args.ctx, K=args.act)
    level = "token" if args.token_level else "action"
    algo = AlgoConfig(level=level, gamma=1.0, lam=1.0)
    ucfg = UpdateConfig(ppo=PPOConfig(epochs=1, num_minibatches=1, micro_batches=1), algo=algo)
    acfg = AdvantageConfig(algo=algo, tokens_per_call=4096)
    from marft_jax.models import sharding

    meshes = {
        "1_device": sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
        "mesh": sharding.make_mesh(args.data, args.fsdp, args.tensor),
    }
    results: dict[str, dict[str, dict]] = {}
    for label, mesh in meshes.items():
        placement = Placement(mesh)
        multiple = placement.row_shards
        base = placement.base(base0)
        state = init_train_state(jax.random.key(1), cfg, LoraConfig(rank=8), args.agents, OptimConfig())
        state = placement.replicate(state)
        costs: dict[str, dict] = {}

        # feature pass
        policy = packing.ShapePolicy(row_multiple=multiple)
        calls, gather, n_main, _ = prepare.feature_inputs(traj, token_level=args.token_level, tokens_per_call=4096,
                                                     policy=policy, placement=placement)
        backup = prepare._upload(placement, jax.tree.map(np.asarray, prepare.backup_inputs(traj)))
        with jax.set_mesh(mesh):       # as the run: prepare_update_batch runs under the context mesh
            costs["features"] = _cost(prepare._values_and_backups.lower(
                base, CriticParams(head=state.critic.head), calls, gather, backup, cfg=cfg, acfg=acfg, n_main=n_main))

        # update (packed policy rows, as a training run)
        shapes = prepare.PrepareShapes()
        for pol in (shapes.features, shapes.logprobs):
            pol.row_multiple = multiple
        critic = CriticParams(head=state.critic.head)
        batch, _ = prepare.prepare_update_batch(base, state.lora, critic, traj, cfg=cfg, acfg=acfg, shapes=shapes,
                                                placement=placement)
        mask = placement.replicate(np.ones(args.agents, bool))
        flag = placement.replicate(np.asarray(True))
        for name, micro in (("update", 1), ("update_micro_batches", args.micro_batches)):
            ucfg = dataclasses.replace(ucfg, ppo=dataclasses.replace(ucfg.ppo, micro_batches=micro))
            learner = TeamLearner(cfg=cfg, base=base, tokenizer=type("T", (), {"pad_id": 0})(), sampler=None,
                                  team=None, score_fn=None, rollout_cfg=None, update_cfg=ucfg, adv_cfg=acfg,
                                  pack_sequences=True, placement=placement)   # only its packed / placement helpers
            packed, _ = learner.pack_update(state, traj, policy=packing.ShapePolicy(row_multiple=multiple))
            placed, packed = learner.place_update(batch, packed)
            with jax.set_mesh(mesh):
                costs[name] = _cost(ppo_update.lower(base, state, placed, mask, flag, cfg=cfg, ucfg=ucfg, packed=packed))

        # one sampler call: the prefill of B x N prompts and the decode loop's body
        rows = args.rows * args.agents
        length = args.ctx
        valid = np.arange(length)[None] >= np.random.default_rng(1).integers(0, length // 2, (rows, 1))
        tokens = np.where(valid, 7, 0).astype(np.int32)
        put = lambda x: placement.rows(x, 0)
        sampling = sampler_lib.SamplingParams.make(1.0, 0, 1.0)
        stop = placement.replicate(sampler_lib.stop_id_array((1,)))
        agent = put(np.arange(rows, dtype=np.int32) % args.agents)
        key = placement.replicate(jax.random.key_data(jax.random.key(3)))
        key = jax.random.wrap_key_data(key)
        lowered = sampler_lib.prefill.lower(base, state.lora, put(tokens), put(valid), put(np.ones(rows, bool)),
                                            agent, stop, key, sampling, jnp.int32(args.act), jnp.int32(0),
                                            cfg=cfg, max_new_tokens=args.act, slots=length + args.act)
        costs["sampler_prefill"] = _cost(lowered)
        st = sampler_lib.prefill(base, state.lora, put(tokens), put(valid), put(np.ones(rows, bool)), agent, stop,
                                 key, sampling, jnp.int32(args.act), jnp.int32(0), cfg=cfg,
                                 max_new_tokens=args.act, slots=length + args.act)
        costs["sampler_decode"] = _cost(sampler_lib.decode.lower(base, state.lora, st, jnp.int32(-1), cfg=cfg))
        results[label] = costs

    stages = {}
    for name, one in results["1_device"].items():
        many = results["mesh"][name]
        stages[name] = {"flops_per_device": many["flops"], "flops_1_device": one["flops"],
                        "ratio": many["flops"] / max(one["flops"], 1.0),
                        "bytes_per_device": many["bytes"], "bytes_1_device": one["bytes"],
                        "bytes_ratio": many["bytes"] / max(one["bytes"], 1.0),
                        "temp_bytes_per_device": many["temp"], "temp_bytes_1_device": one["temp"],
                        "temp_ratio": many["temp"] / max(one["temp"], 1.0)}
    return {"devices": args.devices, "mesh": dict(meshes["mesh"].shape), "level": level,
            "rows": args.rows, "agents": args.agents, "goal_ratio": 1.2 / args.devices, "stages": stages}


def _cost(lowered) -> dict:
    """Per-device FLOPs and bytes accessed of a lowered program (XLA's cost analysis), and the
    temporaries its memory plan holds per device (``memory_analysis``)."""
    compiled = lowered.compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0)),
            "temp": float(compiled.memory_analysis().temp_size_in_bytes)}


def _random_trajectory(rng, vocab: int, *, S: int, B: int, N: int, L: int, K: int):
    """A rollout-shaped trajectory: ragged left-padded contexts and responses, random tokens."""
    import numpy as np

    from marft_jax.rl.trajectory import Trajectory

    ctx = rng.integers(2, vocab, (S, B, N, L)).astype(np.int32)
    cv = np.arange(L) >= rng.integers(0, L // 2, (S, B, N, 1))
    act = rng.integers(2, vocab, (S, B, N, K)).astype(np.int32)
    av = np.arange(K) < rng.integers(K // 4, K + 1, (S, B, N, 1))
    z = np.zeros((S, B, N), np.float32)
    return Trajectory(ctx_tokens=ctx, ctx_valid=cv, act_tokens=act, act_valid=av,
                      sample_logp=np.full(av.shape, -1.0, np.float32), word_count=z.astype(np.int32) + 1,
                      step_mask=np.ones((S, B), bool), terminal=np.ones((S, B), bool),
                      truncated=np.zeros((S, B), bool), score=rng.random((S, B)).astype(np.float32),
                      agent_score=z, boot_ctx_tokens=np.zeros((B, N, L), np.int32),
                      boot_ctx_valid=np.zeros((B, N, L), bool), budget_clipped=z.astype(bool),
                      policy_logp=np.where(av, -1.0, 0.0).astype(np.float32),
                      entropy=np.zeros(av.shape, np.float32))


if __name__ == "__main__":
    main(sys.argv[1:])
