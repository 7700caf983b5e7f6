"""Expected memory per device of Qwen2.5-7B Duo and Quad training at the paper's lengths, from
XLA's compiled memory analysis (nothing 7B-sized is ever allocated).

For each team and each ``(data, fsdp, tensor)`` mesh of D simulated CPU devices, the programs a
training iteration runs are lowered and compiled (not run) with abstract base weights
(``jax.ShapeDtypeStruct`` placed by the run's logical-axis rules) and the inputs placed as the
training loop places them (:mod:`marft_jax.models.placement`, ``TeamLearner.place_update``,
``Sampler.place_on``):

* ``features``: the critic feature pass over the packed contexts, the value head and the backup
  (``prepare._values_and_backups``, the one program ``prepare_update_batch`` runs);
* ``update``: ``rl.update.ppo_update``, every epoch, minibatch and agent of one iteration (critic
  step, then the agent scan with HAPPO weighting and micro-batches), with the packed plan the
  learner builds (``TeamLearner.pack_update``);
* ``sampler_prefill``, ``sampler_decode_first``, ``sampler_resize``, ``sampler_decode_last``: one
  sampler call of a whole batch (``sampling.sampler``: the prefill, the first decode phase, the
  ``resize`` that grows the cache into the last phase, the last phase's decode), with the prompt
  and batch buckets and the decode phases ``Sampler.__call__`` picks (no row stops early, so no
  compaction).

Figures per device (``compiled.memory_analysis()``, :mod:`marft_jax.train.memory_plan`):
argument, output, alias, temp and ``planned = argument + output - alias + temp + code``. The
resident state per device is computed from the placements: base weights (their shard), the
LoRA stack and its AdamW states for N agents, the critic head and its Adam state (replicated),
and the largest KV cache of one sampler call (its shard, as the compiled programs place it).

The trajectory is the worst case of the preset's lengths: every step of every episode played
(no early success), every context ``context_window - max_new_tokens`` tokens and every response
``max_new_tokens`` tokens (a sequence fills the window), random tokens (no shared prefixes).

Two compilations (``--variants``): ``cpu``, XLA:CPU as it is, and ``no_licm``, the same with
``--xla_disable_hlo_passes=while-loop-invariant-code-motion``. XLA:CPU runs bf16 matmuls in
float32 and hoists the float32 converts of the whole stacked weights (and KV cache) out of the
layer loop: several times the bf16 weights in temp bytes that XLA:GPU, which multiplies bf16
natively, never allocates. ``no_licm`` keeps those converts per layer inside the loop, so it is
the closer proxy of a GPU plan (still float32 activations). By default (``--no-explain`` skips it) the
XLA buffer assignments are read back (``--xla_dump_to`` a temporary directory): the largest
temp buffers of each program and ``cpu_f32_copies``, the float32 copies of bf16 arguments.

Usage::

    python experiments/memory_per_device.py     # Duo + Quad, meshes 8,1,1 1,8,1 2,4,1 1,4,2
    python experiments/memory_per_device.py --teams duo --meshes 1,8,1 --variants no_licm
    python experiments/memory_per_device.py --set ppo.micro_batches=1 --programs update

The script re-runs itself in subprocesses (one per variant) with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=D``. It prints markdown tables; the last
stdout line is one JSON object with every number. CPU compilation approximates the GPU's memory
plan (different fusion, scheduling, float types and attention kernel): see docs/many_devices.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

CHILD_FLAG = "--_child"
ROOT = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3

# Qwen2.5-7B(-Instruct) config.json (the fields ModelConfig.from_hf reads).
QWEN25_7B = {
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 131072,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# A tiny model of the same family (the test's fast path).
TINY = dict(QWEN25_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)

PRESET = "paper/math-duo-marft-a-qwen2.5-7b"
TEAMS = {"duo": (2, "math/duo"), "quad": (4, "math/quad")}
DEFAULT_MESHES = ("8,1,1", "1,8,1", "2,4,1", "1,4,2")
PROGRAMS = ("features", "update", "sampler_prefill", "sampler_decode_first", "sampler_resize",
            "sampler_decode_last")
VARIANTS = {"cpu": "", "no_licm": "--xla_disable_hlo_passes=while-loop-invariant-code-motion"}
JIT_NAMES = {"features": "_values_and_backups", "update": "ppo_update", "sampler_prefill": "prefill",
             "sampler_decode_first": "decode", "sampler_resize": "resize", "sampler_decode_last": "decode"}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices D")
    p.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES), help="data,fsdp,tensor (product D)")
    p.add_argument("--teams", nargs="+", default=list(TEAMS), choices=list(TEAMS))
    p.add_argument("--model", default="qwen2.5-7b", choices=("qwen2.5-7b", "tiny"))
    p.add_argument("--preset", default=PRESET)
    p.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="compilations: 'cpu' (XLA:CPU as is) and 'no_licm' (loop-invariant code motion off: "
                        "no whole-stack float32 weight copies hoisted out of the layer loop)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override (repeatable), e.g. --set rollout.rows=64")
    p.add_argument("--no-explain", dest="explain", action="store_false",
                   help="skip reading XLA's buffer assignments (largest temp buffers, CPU-only f32 copies)")
    p.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_dump_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        report = _measure(args)
        print(json.dumps(report))
        return report
    argv = list(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    reports = {v: _spawn(args, argv, v) for v in args.variants}
    report = merge(reports)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["run"] = run_info(argv)
    print(render(report))
    run = report["run"]
    print(f"\n`{run['command']}` at {run['commit']}{' (marft_jax modified)' if run['dirty'] else ''}, "
          f"{run['date']}, {run['machine']}; wall time {report['wall_s']} s")
    print(json.dumps(report))
    return report


def _spawn(args, argv: list[str], variant: str) -> dict:
    """Run the measurement in a subprocess with D simulated devices and ``variant``'s XLA flags."""
    from marft_jax.distributed import simulated_devices_env

    env = simulated_devices_env(args.devices)
    flags = f"{env['XLA_FLAGS']} {VARIANTS[variant]}"
    tmp = None
    if args.explain:   # XLA's buffer assignments, read back to say what the temp bytes hold
        tmp = tempfile.TemporaryDirectory(prefix="memory_per_device_")
        flags += (f" --xla_dump_to={tmp.name} --xla_dump_hlo_module_re="
                  f"jit_({'|'.join(sorted(set(JIT_NAMES.values())))})")
        argv = argv + ["--_dump_dir", tmp.name]
    env["XLA_FLAGS"] = " ".join(flags.split())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    print(f"variant {variant}: XLA_FLAGS={env['XLA_FLAGS']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, CHILD_FLAG], env=env,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if out.returncode != 0:
        raise SystemExit(f"memory_per_device: the {args.devices}-device subprocess ({variant}) failed "
                         f"(exit {out.returncode})")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["xla_flags"] = VARIANTS[variant]
    return report


def run_info(argv: list[str]) -> dict:
    """Command, commit, date and machine of this run."""
    import datetime
    import platform

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None
        except OSError:
            return None

    cpu = None
    try:
        cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                    if l.startswith("model name")), None)
    except OSError:
        pass
    return {"command": " ".join(["python experiments/memory_per_device.py", *argv]),
            "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "marft_jax")),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()}: {cpu or platform.processor()}, {os.cpu_count()} CPUs, "
                       f"Python {platform.python_version()}"}


def merge(reports: dict[str, dict]) -> dict:
    """One report of several variants: the first variant's, every program's figures of the
    others added as ``<field>_<variant>``, plus ``variants`` (flags and wall time of each)."""
    names = list(reports)
    out = json.loads(json.dumps(reports[names[0]]))
    out["variant"] = names[0]
    out["variants"] = {v: {"xla_flags": r["xla_flags"], "wall_s": r["wall_s"]} for v, r in reports.items()}
    for v in names[1:]:
        for team, t in reports[v]["teams"].items():
            for m, r in t["meshes"].items():
                dst = out["teams"][team]["meshes"][m]
                for name, b in r["programs"].items():
                    dst["programs"].setdefault(name, {}).update({f"{k}_{v}": x for k, x in b.items()})
                dst["peak_planned_" + v] = r["peak_planned"]
                for name, e in r["errors"].items():
                    dst["errors"][f"{name}_{v}"] = e
    return out


# ---------------------------------------------------------------------------------------------


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract or placed pytree (its shard of each leaf; the
    whole leaf where the leaf has no sharding)."""
    import math

    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        shape = tuple(sh.shard_shape(x.shape)) if sh is not None else tuple(x.shape)
        dt = x.dtype
        size = 8 if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key) else np.dtype(dt).itemsize
        total += math.prod(shape) * size
    return int(total)


def _flops(compiled) -> float | None:
    """XLA's per-device FLOPs of a compiled program (its cost analysis; while loops counted once)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:
        return None
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0)) if ca else None


def _abstract(x, sharding=None):
    import jax

    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if sharding is not None
                                else getattr(x, "sharding", None))


def _out_structs(compiled):
    """The compiled program's outputs as ShapeDtypeStructs with their shardings (what the next
    program of the loop receives)."""
    import jax

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding), compiled.out_info)


_ALLOC = re.compile(r"^allocation \d+: size (\d+)(.*?)$\n((?:^ .*$\n)*)", re.M)
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\w+)\[([\d,]*)\]")
_PARAM = re.compile(r"parameter \d+, shape \|(\w+)\[([\d,]*)\]\|")


def explain_buffers(text: str, top: int = 4) -> dict:
    """What the temp allocation of one XLA buffer assignment (``--xla_dump_to``) holds.

    Returns ``largest_temp``: the ``top`` largest temp buffers (distinct placements) as
    ``"name dtype[dims] GiB"``, and ``cpu_f32_copies``: bytes of float32 converts of bf16 program
    arguments (weights, KV cache) held in the temp. XLA:CPU runs bf16 matmuls in float32 and
    hoists those converts out of the layer loop; XLA:GPU computes in bf16 and keeps none.
    """
    allocs = _ALLOC.findall(text)
    bf16_params = {dims for header, _ in ((a[1], a[2]) for a in allocs)
                   for dtype, dims in _PARAM.findall(header) if dtype == "bf16"}
    temp = [a for a in allocs if "preallocated-temp" in a[1]]
    if not temp:
        return {"largest_temp": [], "cpu_f32_copies": 0}
    values = [(name, int(size), int(off), dtype, dims) for name, size, off, dtype, dims in _VALUE.findall(temp[0][2])]
    placed: dict[tuple[int, int], tuple] = {}
    for v in sorted(values, key=lambda v: -v[1]):
        placed.setdefault((v[2], v[1]), v)
    largest = [f"{n} {d}[{dims}] {size / GIB:.2f} GiB" for n, size, _, d, dims in list(placed.values())[:top]]
    copies, taken = 0, []
    for name, size, off, dtype, dims in sorted(placed.values(), key=lambda v: -v[1]):
        if dtype == "f32" and "convert" in name and dims in bf16_params:
            if all(off + size <= a or b <= off for a, b in taken):
                taken.append((off, off + size))
                copies += size
    return {"largest_temp": largest, "cpu_f32_copies": copies}


def _latest_dump(dump_dir: str, jit_name: str, seen: set) -> str | None:
    """The buffer assignment of the newest not yet read module ``jit_<jit_name>``."""
    files = sorted(Path(dump_dir).glob(f"module_*.jit_{jit_name}.*buffer-assignment.txt"))
    files = [f for f in files if f not in seen]
    if not files:
        return None
    seen.add(files[-1])
    return files[-1].read_text()


def worst_case_trajectory(rng, vocab: int, *, S: int, B: int, N: int, ctx: int, K: int):
    """Every step played, every context ``ctx`` tokens, every response ``K`` tokens (random ids)."""
    import numpy as np

    from marft_jax.rl.trajectory import Trajectory
    from marft_jax.sampling.buckets import length_bucket

    L = length_bucket(ctx)                  # the rollout's context bucket (powers of two)
    ctx_tokens = rng.integers(2, vocab, (S, B, N, L)).astype(np.int32)
    ctx_valid = np.broadcast_to(np.arange(L) >= L - ctx, (S, B, N, L)).copy()
    act = rng.integers(2, vocab, (S, B, N, K)).astype(np.int32)
    act_valid = np.ones((S, B, N, K), bool)
    z = np.zeros((S, B, N), np.float32)
    terminal = np.zeros((S, B), bool)
    terminal[-1] = True
    return Trajectory(ctx_tokens=ctx_tokens, ctx_valid=ctx_valid, act_tokens=act, act_valid=act_valid,
                      sample_logp=np.full((S, B, N, K), -1.0, np.float32), word_count=z.astype(np.int32) + 100,
                      step_mask=np.ones((S, B), bool), terminal=terminal, truncated=np.zeros((S, B), bool),
                      score=np.zeros((S, B), np.float32), agent_score=z,
                      boot_ctx_tokens=np.zeros((B, N, L), np.int32), boot_ctx_valid=np.zeros((B, N, L), bool),
                      budget_clipped=np.ones((S, B, N), bool),
                      policy_logp=np.full((S, B, N, K), -1.0, np.float32),
                      entropy=np.ones((S, B, N, K), np.float32))


def _measure(args) -> dict:
    import types

    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from marft_jax import distributed
    from marft_jax.config import MeshSection, load_config
    from marft_jax.models import decoder, sharding
    from marft_jax.models.config import ModelConfig
    from marft_jax.rl import advantages
    from marft_jax.rl.advantages import AdvantageConfig
    from marft_jax.rl.state import init_train_state
    from marft_jax.rl.update import UpdateBatch, ppo_update
    from marft_jax.sampling import buckets
    from marft_jax.sampling import sampler as sampler_lib
    from marft_jax.train import build, memory_plan, prepare
    from marft_jax.train.iteration import TeamLearner
    from marft_jax.models.placement import Placement

    if jax.device_count() != args.devices:
        raise SystemExit(f"expected {args.devices} devices, have {jax.device_count()}")
    hf = QWEN25_7B if args.model == "qwen2.5-7b" else TINY
    mcfg = ModelConfig.from_hf(hf)          # attention "xla": the only implementation XLA:CPU compiles
    stop_ids = (151645, 151643) if args.model == "qwen2.5-7b" else (3,)
    pad_id = 151643 if args.model == "qwen2.5-7b" else 0
    report: dict = {"model": args.model, "model_config": hf, "num_params": mcfg.num_params(),
                    "preset": args.preset, "overrides": list(args.overrides), "devices": args.devices,
                    "backend": jax.default_backend(), "jax": jax.__version__, "teams": {}}
    base_shapes = None
    seen_dumps: set = set()
    for team in args.teams:
        n_agents, profile = TEAMS[team]
        cfg = load_config(args.preset, ["model.dtype=bfloat16", f"team.num_agents={n_agents}",
                                        f"team.profile={profile}", *args.overrides])
        dtype = build.model_dtype(cfg)
        r = cfg.rollout
        S, B, N, K = r.horizon, r.rows, n_agents, r.max_new_tokens
        ctx_len = r.context_window - K
        ucfg = build.update_config(cfg)
        share = cfg.ppo.share_prefixes        # the GPU's attention (cudnn) takes shared prefixes too
        token_level = cfg.algo.level == "token"
        settings = {"level": cfg.algo.level, "horizon": S, "rows": B, "agents": N, "context_window": r.context_window,
                    "context_tokens": ctx_len, "max_new_tokens": K, "lora_rank": cfg.lora.rank,
                    "lora_targets": list(cfg.lora.targets), "epochs": cfg.ppo.epochs,
                    "num_minibatches": cfg.ppo.num_minibatches, "micro_batches": cfg.ppo.micro_batches,
                    "remat": ucfg.remat, "agent_schedule": ucfg.agent_schedule,
                    "happo_weighting": ucfg.happo_weighting, "base_dtype": str(jnp.dtype(dtype)),
                    "share_prefixes": share, "pack_sequences": cfg.ppo.pack_sequences}
        traj = worst_case_trajectory(np.random.default_rng(0), mcfg.vocab_size, S=S, B=B, N=N, ctx=ctx_len, K=K)
        if base_shapes is None:
            base_shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.key(0), mcfg, dtype=dtype))
        state_shapes = jax.eval_shape(lambda k: init_train_state(k, mcfg, cfg.lora, N, ucfg.optim,
                                                                 critic_lora=cfg.ppo.critic_lora),
                                      jax.random.key(0))
        team_out: dict = {"settings": settings, "meshes": {}}
        for mesh_arg in args.meshes:
            data, fsdp, tensor = (int(x) for x in mesh_arg.split(","))
            label = f"data={data} fsdp={fsdp} tensor={tensor}"
            print(f"[{team}] mesh {label}", file=sys.stderr, flush=True)
            mesh = distributed.build_mesh(MeshSection(data=data, fsdp=fsdp, tensor=tensor, strict=cfg.mesh.strict),
                                          mcfg, rows=B)
            placement = Placement(mesh, strict=cfg.mesh.strict)
            shardings = sharding.param_shardings(base_shapes, mesh, placement.rules, strict=cfg.mesh.strict)
            base = jax.tree.map(_abstract, base_shapes, shardings)
            state = jax.tree.map(lambda x: _abstract(x, placement.replicated), state_shapes)
            learner = TeamLearner(cfg=mcfg, base=base, tokenizer=types.SimpleNamespace(pad_id=pad_id),
                                  sampler=None, team=None, score_fn=None, rollout_cfg=None,
                                  update_cfg=ucfg, adv_cfg=None, pack_sequences=cfg.ppo.pack_sequences,
                                  share_prefixes=share, placement=placement)
            progs: dict[str, dict] = {}
            errors: dict[str, str] = {}

            def plan(name, fn, *a, **kw):
                if name not in args.programs:
                    return None
                t = time.perf_counter()
                try:
                    compiled, _ = memory_plan.plan_of(fn, *a, **kw)
                except Exception as e:   # a mesh XLA cannot partition: reported, the rest goes on
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    print(f"  {name}: FAILED {errors[name]}", file=sys.stderr, flush=True)
                    return None
                b = memory_plan.memory_breakdown(compiled) or {}
                b = {k: v for k, v in b.items() if not k.startswith("host_")}
                b["planned"] = memory_plan.planned_bytes(compiled)
                b["flops"] = _flops(compiled)
                b["compile_s"] = round(time.perf_counter() - t, 1)
                if args._dump_dir:
                    text = _latest_dump(args._dump_dir, JIT_NAMES[name], seen_dumps)
                    if text is not None:
                        b.update(explain_buffers(text))
                progs[name] = b
                print(f"  {name}: planned {b['planned'] / GIB:.2f} GiB, temp {b['temp'] / GIB:.2f} GiB "
                      f"({b['compile_s']} s)", file=sys.stderr, flush=True)
                return compiled

            # --- the feature pass (prepare_update_batch, under the run's mesh context)
            with learner.mesh_context():
                acfg = AdvantageConfig(algo=cfg.algo, ppo=cfg.ppo, rollout=cfg.rollout, share_prefixes=share)
                calls, gather, n_main, fstats = prepare.feature_inputs(
                    traj, token_level=token_level, tokens_per_call=acfg.tokens_per_call,
                    policy=learner.run_state.prepare.features, placement=placement, share=share)
                backup = placement.replicate(jax.tree.map(np.asarray, prepare.backup_inputs(traj)))
                plan("features", prepare._values_and_backups, base, state.critic, calls, gather, backup, cfg=mcfg,
                     acfg=acfg, n_main=n_main)

            # --- the update batch as prepare_update_batch leaves it (shapes and dtypes), placed
            f32 = lambda *s: np.zeros(s, np.float32)
            dp_shape = (S, B, N, K) if token_level else (S, B, N)
            feats = np.zeros(dp_shape + (mcfg.hidden_size,), ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else dtype)
            adv_out = jax.eval_shape(
                advantages.advantages, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (
                    f32(*dp_shape), traj.act_valid, traj.step_mask, traj.score, traj.agent_score, traj.terminal,
                    traj.truncated, f32(B, N))), acfg=AdvantageConfig(algo=cfg.algo))
            value, dp, _, adv, ret = (np.zeros(x.shape, x.dtype) for x in adv_out)
            batch = UpdateBatch(ctx_tokens=None, ctx_valid=None, act_tokens=traj.act_tokens,
                                act_valid=traj.act_valid, logp_old=traj.policy_logp, adv=adv, ret=ret, v_old=value,
                                dp_mask=dp, feats=feats, word_count=traj.word_count)
            with learner.mesh_context():
                upd_plan, ustats = learner.pack_update(types.SimpleNamespace(rng=jax.random.key(0)), traj)
                batch, upd_plan = learner.place_update(batch, upd_plan)
                mask = jnp.ones((N,), bool)
                plan("update", ppo_update, base, state, batch, mask, jnp.asarray(True), cfg=mcfg, ucfg=ucfg,
                     packed=upd_plan)

            # --- one sampler call (Sampler.__call__'s buckets and phases; sequential: one agent, B rows)
            smp = sampler_lib.Sampler(mcfg, pad_id=pad_id, stop_ids=stop_ids, max_prompt_len=r.context_window)
            smp.place_on(placement)
            prompts = [list(row[-ctx_len:]) for row in traj.ctx_tokens[0, :, 0]]
            pb = buckets.pad_prompts(prompts, pad_id=pad_id, min_length=smp.min_prompt_bucket,
                                     max_length=smp.max_prompt_len, min_batch=smp.min_batch,
                                     max_batch=smp.max_batch, fine_above=smp.fine_above)
            rows, length = pb.tokens.shape
            phases = sampler_lib.decode_phases(length, K)
            sampling = sampler_lib.SamplingParams.make(r.temperature, r.top_k, r.top_p,
                                                       policy_temperature=r.temperature)
            static = dict(top_k_max=sampler_lib.top_k_bucket(r.top_k, mcfg.vocab_size), use_top_p=r.top_p < 1.0)
            with smp._mesh_context():      # as Sampler.__call__ runs them
                pre = plan("sampler_prefill", sampler_lib.prefill, base, state.lora, smp._rows(pb.tokens),
                           smp._rows(pb.valid), smp._rows(pb.active), jnp.int32(0),
                           jnp.asarray(sampler_lib.stop_id_array(stop_ids)), jax.random.key(0), sampling,
                           jnp.int32(K), jnp.int32(pad_id), cfg=mcfg, max_new_tokens=K, slots=length + phases[0],
                           **static)
                caches = []
                floor = jnp.int32(rows // 2 if rows // 2 >= smp.min_compact_batch else -1)
                if pre is not None:
                    st = _out_structs(pre)
                    caches.append(st.cache)
                    plan("sampler_decode_first", sampler_lib.decode, base, state.lora, st, floor, cfg=mcfg, **static)
                    if len(phases) > 1:    # the cache grows into the last phase (no row finished: no compaction)
                        res = plan("sampler_resize", sampler_lib.resize, st, jnp.arange(rows, dtype=jnp.int32),
                                   jnp.ones((rows,), bool), slots=length + phases[-1], compact=False)
                        if res is not None:
                            st = _out_structs(res)
                            caches.append(st.cache)
                            plan("sampler_decode_last", sampler_lib.decode, base, state.lora, st, floor, cfg=mcfg,
                                 **static)
            kv = max(caches, key=_bytes_per_device) if caches else None
            resident = {"base": _bytes_per_device(base),
                        "lora_and_adamw": _bytes_per_device((state.lora, state.lora_opt)),
                        "critic_and_adam": _bytes_per_device((state.critic, state.critic_opt)),
                        "kv_cache": _bytes_per_device(kv) if kv is not None else None}
            resident["total"] = sum(v for v in resident.values() if v is not None)
            planned = [b["planned"] for b in progs.values() if b.get("planned") is not None]
            team_out["meshes"][mesh_arg] = {
                "mesh": dict(mesh.shape), "programs": progs, "errors": errors, "resident": resident,
                "peak_planned": max(planned) if planned else None,
                "shapes": {"feature_calls": [list(c.tokens.shape) for c in calls], "feature_tokens": fstats,
                           "update_rows": [list(x.tokens.shape) for x in upd_plan.rows],
                           "update_tokens": {k: v for k, v in ustats.items() if k != "shape"},
                           "sampler_batch": rows, "prompt_bucket": length, "decode_phases": list(phases)}}
        report["teams"][team] = team_out
    return report


def _g(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def render(report: dict) -> str:
    """Markdown tables of a (merged) report, GiB per device."""
    extra = [v for v in report.get("variants", {}) if v != report.get("variant", "cpu")]
    head = ("| team | mesh (data x fsdp x tensor) | program | argument | output | alias | temp "
            "| of which f32 copies | planned |")
    rule = "|---|---|---|---:|---:|---:|---:|---:|---:|"
    for v in extra:
        head += f" temp, {v} | planned, {v} |"
        rule += "---:|---:|"
    out = [head, rule]
    mesh_name = lambda r: "x".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
    for team, t in report["teams"].items():
        for r in t["meshes"].values():
            for name, b in r["programs"].items():
                row = (f"| {team} | {mesh_name(r)} | {name} | {_g(b.get('argument'))} | {_g(b.get('output'))} "
                       f"| {_g(b.get('alias'))} | {_g(b.get('temp'))} | {_g(b.get('cpu_f32_copies'))} "
                       f"| **{_g(b.get('planned'))}** |")
                for v in extra:
                    row += f" {_g(b.get('temp_' + v))} | **{_g(b.get('planned_' + v))}** |"
                out.append(row)
            for name, e in r["errors"].items():
                out.append(f"| {team} | {mesh_name(r)} | {name} | did not compile: {e[:80]} |")
    head = ("| team | mesh | base weights | LoRA + AdamW | critic head + Adam | KV cache (one call) "
            "| resident total | peak planned |")
    rule = "|---|---|---:|---:|---:|---:|---:|---:|"
    for v in extra:
        head += f" peak planned, {v} |"
        rule += "---:|"
    out += ["", head, rule]
    for team, t in report["teams"].items():
        for r in t["meshes"].values():
            res = r["resident"]
            row = (f"| {team} | {mesh_name(r)} | {_g(res['base'])} | {_g(res['lora_and_adamw'])} "
                   f"| {_g(res['critic_and_adam'])} | {_g(res['kv_cache'])} | {_g(res['total'])} "
                   f"| **{_g(r['peak_planned'])}** |")
            for v in extra:
                row += f" **{_g(r.get('peak_planned_' + v))}** |"
            out.append(row)
    for v in [report.get("variant", "cpu"), *extra]:
        key = "largest_temp" if v == report.get("variant", "cpu") else f"largest_temp_{v}"
        largest = [f"- {team}, {mesh_name(r)}, {name}: " + "; ".join(b[key])
                   for team, t in report["teams"].items() for r in t["meshes"].values()
                   for name, b in r["programs"].items() if b.get(key)]
        if largest:
            out += ["", f"Largest temp buffers per device ({v}):", *largest]
    return "\n".join(out)


if __name__ == "__main__":
    main()
