"""``marft-jax preflight``: lower every program of a run for the accelerator it will run on, on
any CPU, offline, before paying for the pod.

``marft-jax preflight CONFIG [key=value ...] --platform tpu|cuda|cpu --devices N`` builds the
run's pieces as :func:`marft_jax.train.build.build_run` does (team, sampler, learner, mesh over
``N`` devices: simulated CPU devices, the process re-runs itself with that count), but with
*abstract* base weights (``jax.ShapeDtypeStruct``: nothing is loaded or allocated), and lowers
each program the run compiles, with the attention implementation the run would use there
(``model.attention=auto`` resolved for that backend with the weights' dtype, bf16 on GPU/TPU):

* ``prefill`` at every prompt bucket the sampler can produce (:mod:`marft_jax.sampling.buckets`,
  up to ``rollout.context_window``), ``decode`` at every phase of each bucket
  (:func:`~marft_jax.sampling.sampler.decode_phases`), for the training batch and, as
  ``eval prefill`` / ``eval decode``, for the evaluation batch;
* ``features+backup`` (:func:`marft_jax.train.prepare._values_and_backups`; ``backup``,
  :func:`~marft_jax.train.prepare._critic_free_backups`, for a critic-free estimator), the log-prob
  ``recompute`` forward and the PPO ``update`` (its gradient inside) at the packed row classes the
  run's own planners (:class:`~marft_jax.rl.packing.ShapePolicy`) pick for synthetic rollouts
  of short, typical and long sequences, plus single-class rows of :data:`KERNEL_LENGTHS`
  (the lengths at which the Pallas and cuDNN kernels' rules differ).

``tpu`` exports with ``jax.export`` (``platforms=['tpu']``); ``cuda`` lowers with
``jit(f).trace(...).lower(lowering_platforms=('cuda',))``, with JAX's cuDNN version probe
answered as on an H100 with cuDNN 9.10 (:func:`cudnn_assumed`); ``cpu`` compiles and prints
each program's memory plan per device against the machine's memory
(:mod:`marft_jax.train.memory_plan`). One line per (program, shape, attention): ``ok`` or
``FAIL`` with the error and the config key to change; the first failure ends it (exit 1).

The model's architecture comes, in order, from a local directory's ``config.json``, a GGUF
header, the Hugging Face cache, the Hub (``config.json`` only; not with ``HF_HUB_OFFLINE=1``,
the CLI's default) or :mod:`marft_jax.models.known_configs`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

PLATFORMS = ("tpu", "cuda", "cpu")
BACKEND = {"tpu": "tpu", "cuda": "gpu", "cpu": "cpu"}      # marft_jax.models.attention's backend names
DEVICES_ENV = "MARFT_PREFLIGHT_DEVICES"                    # set in the re-run child
# Single-class packed rows lowered besides the planners' shapes: the lengths where the kernels'
# rules part (splash: multiples of 128, <= 512 or multiples of 512; TPU flash: >= 128; Triton
# mha: <= 128 or multiples of 128; an odd length for cuDNN's training path).
KERNEL_LENGTHS = (32, 96, 160, 640)
PROFILES = ("short", "typical", "long")
# GPU assumed by the cuDNN lowering (compute capability) and cuDNN version (major*10000+minor*100).
ASSUMED_COMPUTE_CAPABILITY = "9.0"
ASSUMED_CUDNN = 91000


class PreflightError(ValueError):
    """The config or model cannot be checked (names the key)."""


# ------------------------------------------------------------------------------- architecture


def model_architecture(name: str, revision: str | None = None):
    """``(ModelConfig, where it came from)`` for ``model.name`` without reading any weights.

    In order: a local directory's ``config.json``; a ``.gguf`` file's header (and the embedded
    ``smollm2-135m``); the Hugging Face cache; the Hub (``config.json`` only, skipped with
    ``HF_HUB_OFFLINE=1``); :func:`marft_jax.models.known_configs.hf_config`. Raises
    :class:`PreflightError` naming ``model.name`` when none has it, and
    :class:`~marft_jax.models.config.UnsupportedConfigError` for an architecture the decoder lacks.
    """
    from marft_jax.models import gguf_loader, known_configs, registry
    from marft_jax.models.config import ModelConfig

    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise PreflightError(f"model.name={name!r}: the directory has no config.json")
        return ModelConfig.from_hf(json.loads(cfg_file.read_text())), str(cfg_file)
    gguf = registry.embedded_gguf_path(name) if name in registry.NAMED_MODELS else path
    if str(gguf).endswith(".gguf") and Path(gguf).is_file():
        return gguf_loader.gguf_model_config(gguf_loader.open_gguf(gguf)), f"{gguf} (GGUF header)"
    if "/" in name and not path.exists():
        found = _hub_config(name, revision)
        if found is not None:
            return ModelConfig.from_hf(json.loads(Path(found[0]).read_text())), found[1]
    known = known_configs.hf_config(name)
    if known is not None:
        return ModelConfig.from_hf(known), "marft_jax.models.known_configs"
    raise PreflightError(
        f"model.name={name!r}: no local directory or .gguf file, not in the Hugging Face cache"
        f"{'' if _offline() else ' nor on the Hub'}, and not a known model "
        f"({', '.join(known_configs.NAMES)})")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _hub_config(repo: str, revision: str | None) -> tuple[str, str] | None:
    """``(config.json path, source)`` from the HF cache, else the Hub unless offline; None if neither."""
    try:
        import huggingface_hub as hub
    except ImportError:
        return None
    try:
        cached = hub.try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:          # a malformed repo id: not a Hub name
        return None
    if isinstance(cached, str):
        return cached, f"{cached} (Hugging Face cache)"
    if _offline():
        return None
    try:
        got = hub.hf_hub_download(repo, "config.json", revision=revision)
    except Exception:
        return None
    return got, f"{repo}@{revision or 'main'} config.json (Hub)"


# ------------------------------------------------------------------------------- the run's pieces


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a run at one shape: ``fn`` (a ``jax.jit`` function) with ``args`` /
    ``kwargs`` (abstract or small placed arrays; static arguments by keyword), lowered under
    ``mesh`` (the run's context mesh, or None on one device)."""

    name: str
    shape: str
    keys: str                  # config keys that change this program (named on failure)
    fn: Any
    args: tuple
    kwargs: dict
    mesh: Any = None


@dataclasses.dataclass
class RunModel:
    """The run as preflight sees it: the config, its resolved model (attention included), the
    parameter dtype, the placement (a 1-device mesh on one device) and the abstract base weights / state."""

    config: Any
    model: Any
    dtype: Any
    placement: Any
    base: Any
    state: Any


def platform_dtype(cfg, platform: str):
    """The weights' dtype on ``platform``: ``model.dtype``, or for ``auto`` bf16 on GPU/TPU and
    float32 on the CPU (:func:`marft_jax.models.registry.default_dtype`'s rule)."""
    import jax.numpy as jnp

    if cfg.model.dtype == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cfg.model.dtype]


def resolve_model(cfg, model, platform: str, devices: int, attention: str | None = None):
    """``model`` with ``model.attention`` (or ``attention``), ``model.decode_attention``,
    ``model.decode_matmul`` and ``model.causal_attention`` resolved for ``platform`` as a run
    there resolves them."""
    from marft_jax.config import ConfigError
    from marft_jax.models import attention as attention_lib
    from marft_jax.models import cache_attention, causal_attention, layer_matmul

    dtype = platform_dtype(cfg, platform)
    try:
        impl = attention_lib.resolve(attention or cfg.model.attention, backend=BACKEND[platform], dtype=dtype)
        decode = cache_attention.resolve(cfg.model.decode_attention, backend=BACKEND[platform], dtype=dtype,
                                         devices=devices)
        matmul = layer_matmul.resolve(cfg.model.decode_matmul, backend=BACKEND[platform], dtype=dtype,
                                      devices=devices)
        causal = causal_attention.resolve(cfg.model.causal_attention, backend=BACKEND[platform], dtype=dtype,
                                          devices=devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(model, attention=impl, decode_attention=decode, decode_matmul=matmul,
                               causal_attention=causal)


def build(cfg, model, devices: int, platform: str) -> RunModel:
    """The run's placement over the first ``devices`` devices (a 1-device mesh for one, as
    ``build_run``) and its abstract base weights (sharded by the placement's rules) and train state."""
    import jax

    from marft_jax import distributed
    from marft_jax.models import decoder
    from marft_jax.models.placement import Placement
    from marft_jax.rl import advantages
    from marft_jax.rl.state import init_train_state

    if jax.device_count() < devices:
        raise PreflightError(f"--devices {devices}: this process has {jax.device_count()} devices")
    dtype = platform_dtype(cfg, platform)
    mesh = distributed.build_mesh(cfg.mesh, model, rows=cfg.rollout.rows, devices=jax.devices()[:devices])
    placement = Placement(mesh, strict=cfg.mesh.strict)
    base = jax.eval_shape(functools.partial(decoder.init_params, cfg=model, dtype=dtype), jax.random.key(0))
    state = jax.eval_shape(functools.partial(init_train_state, cfg=model, lora_cfg=cfg.lora,
                                             num_agents=cfg.team.num_agents, optim=cfg.optim,
                                             critic_lora=cfg.ppo.critic_lora,
                                             critic=advantages.needs_critic(cfg.algo)), jax.random.key(0))
    shard = placement.base_shardings(base)
    base = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), base, shard)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placement.replicated), state)
    return RunModel(config=cfg, model=model, dtype=dtype, placement=placement, base=base, state=state)


def _rows_struct(placement, x, axis: int):
    """``x`` as a ShapeDtypeStruct placed as :meth:`Placement.rows` places an array (rows split
    over the row shards on ``axis`` where they divide it, else replicated)."""
    import jax

    if x is None:
        return None
    ok = x.ndim > axis and x.shape[axis] % placement.row_shards == 0
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=placement.row_sharding(x.ndim, axis) if ok else placement.replicated)


class _Tokenizer:
    """What the learner's planners read of a tokenizer."""

    pad_id = 0


def learner(run: RunModel):
    """The run's :class:`~marft_jax.train.iteration.TeamLearner` (its shape policies, planners
    and placement helpers) over the abstract weights; it never plays or scores."""
    from marft_jax.sampling.sampler import Sampler
    from marft_jax.train import build as build_lib
    from marft_jax.train.iteration import TeamLearner
    from marft_jax.rl.advantages import AdvantageConfig

    cfg, model = run.config, run.model
    team = build_lib.build_team(cfg)
    share = build_lib.share_prefixes(cfg, model.attention)
    sampler = Sampler(model, pad_id=0, stop_ids=(1,), max_prompt_len=cfg.rollout.context_window)
    sampler.place_on(run.placement)
    return TeamLearner(
        cfg=model, base=run.base, tokenizer=_Tokenizer(), sampler=sampler, team=team, score_fn=None,
        rollout_cfg=cfg.rollout, update_cfg=build_lib.update_config(cfg, team.topology),
        adv_cfg=AdvantageConfig(algo=cfg.algo, ppo=cfg.ppo, rollout=cfg.rollout,
                                independent=team.topology.independent, topology=team.topology,
                                layer_links=team.layer_links, share_prefixes=share),
        pack_sequences=cfg.ppo.pack_sequences, share_prefixes=share, placement=run.placement)


# ------------------------------------------------------------------------------- sampler programs


def prompt_buckets(cfg, sampler) -> list[int]:
    """Every prompt bucket the sampler can produce for prompts of 1 .. ``rollout.context_window`` tokens."""
    from marft_jax.sampling import buckets

    out = set()
    for n in range(1, cfg.rollout.context_window + 1):
        out.add(buckets.prompt_bucket(n, minimum=sampler.min_prompt_bucket, maximum=sampler.max_prompt_len,
                                      fine_above=sampler.fine_above))
    return sorted(out)


def sampler_programs(run: RunModel, lrn, *, batch: int, sampling, label: str = "",
                     prompt_lengths: Sequence[int] | None = None, phases: bool = True) -> Iterator[Program]:
    """The prefill at each prompt bucket (``prompt_lengths``: only those buckets) and the decode
    of each of its phases, for ``batch`` prompts sampled with ``sampling`` (a RolloutConfig),
    the arguments built by :meth:`Sampler.prefill_call`, as a real call builds them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marft_jax.sampling import sampler as sampler_lib

    sampler, model, placement = lrn.sampler, run.model, run.placement
    width = max(len(layer) for layer in lrn.team.topology.layers)
    lengths = prompt_lengths or prompt_buckets(run.config, sampler)
    config = sampler_lib.SamplingConfig(sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p)
    mesh = placement.mesh
    for n in lengths:
        call = sampler.prefill_call([[1] * n] * batch, key=jax.random.key(0), config=config, lora=run.state.lora,
                                    agent=0 if width == 1 else [0] * batch,
                                    policy_temperature=run.config.rollout.temperature,
                                    rows=lambda x: _rows_struct(placement, np.asarray(x), 0))
        b, length = call.batch.tokens.shape
        args, kwargs, static, bounds = (run.base, run.state.lora) + call.args, call.kwargs, call.static, call.phases
        yield Program(f"{label}prefill", f"{b} x {length} tokens", "rollout.context_window", sampler_lib.prefill,
                      args, kwargs, mesh)
        if not phases:
            continue
        if not label and run.config.rollout.reuse_prefix and length >= 2 * sampler.min_prompt_bucket:
            yield _prefix_prefill(run, lrn, batch=batch, length=length, config=config)
        first = sampler_lib.prefill.trace(*args, **dict(kwargs, cfg=_shape_model(model))).out_info
        for bound in bounds:
            state = _decode_state(first, run, length + bound)
            yield Program(f"{label}decode", f"{b} rows, {length} + {bound} slots",
                          "rollout.max_new_tokens, rollout.context_window", sampler_lib.decode,
                          (run.base, run.state.lora, state, jnp.int32(-1)), static, mesh)


def _prefix_prefill(run: RunModel, lrn, *, batch: int, length: int, config) -> "Program":
    """The rollout's prefill after a reused prompt prefix (``rollout.reuse_prefix``) whose whole
    prompts fill the ``length`` bucket: half of it reused, the rest prefilled, the cache then
    compacted to ``length`` slots (:mod:`marft_jax.sampling.prefix_reuse`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marft_jax.sampling import sampler as sampler_lib
    from marft_jax.sampling.prefix_reuse import PrefixKV

    sampler, model, placement = lrn.sampler, run.model, run.placement
    width = max(len(layer) for layer in lrn.team.topology.layers)
    reused = sampler.length_bucket(length // 2)
    call = sampler.prefill_call([[1] * (length - length // 2)] * batch, key=jax.random.key(0), config=config,
                                lora=run.state.lora, agent=0 if width == 1 else [0] * batch,
                                policy_temperature=run.config.rollout.temperature, whole_len=length,
                                rows=lambda x: _rows_struct(placement, np.asarray(x), 0))
    b, rest = call.batch.tokens.shape
    kv = jax.ShapeDtypeStruct((model.num_layers, b, model.num_kv_heads, reused, model.head_dim),
                              run.base["embed"].dtype)
    prefix = PrefixKV(k=_rows_struct(placement, kv, 1), v=_rows_struct(placement, kv, 1),
                      valid=_rows_struct(placement, jax.ShapeDtypeStruct((b, reused), jnp.bool_), 0),
                      lengths=_rows_struct(placement, jax.ShapeDtypeStruct((b,), jnp.int32), 0))
    return Program("prefill after prefix", f"{b} x {reused} reused + {rest} tokens -> {length}",
                   "rollout.context_window, rollout.reuse_prefix", sampler_lib.prefill,
                   (run.base, run.state.lora) + call.args, dict(call.kwargs, prefix=prefix, whole_len=length),
                   placement.mesh)


def _shape_model(model):
    """``model`` with XLA attention: the programs' output shapes, traced without the kernels
    (whose own failures belong to the lowering of the program itself)."""
    return dataclasses.replace(model, attention="xla")


def _decode_state(prefilled, run: RunModel, slots: int):
    """The sampler state of a decode phase with a ``slots``-slot cache, rows split over the row
    shards as the sampler keeps them (the cache on its batch axis 1)."""
    import jax

    cache = prefilled.cache
    grow = lambda x, axis: jax.ShapeDtypeStruct(x.shape[:axis] + (slots,) + x.shape[axis + 1:], x.dtype)
    state = prefilled.replace(cache=cache.replace(k=grow(cache.k, 3), v=grow(cache.v, 3), valid=grow(cache.valid, 1)))
    batch = state.last.shape[0]

    def place(path, x):
        in_cache = any(getattr(p, "name", None) in ("k", "v") for p in path)
        axis = 1 if in_cache else 0
        if x.ndim > axis and x.shape[axis] == batch:
            return _rows_struct(run.placement, x, axis)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=run.placement.replicated)

    return jax.tree_util.tree_map_with_path(place, state)


# ------------------------------------------------------------------------------- training programs


def synthetic_trajectory(cfg, profile: str, *, vocab: int, seed: int = 0, window: int | None = None,
                         steps: int | None = None):
    """A rollout-shaped :class:`~marft_jax.rl.trajectory.Trajectory` of ``profile`` lengths:
    ``short`` (prompts of 2-8 % of the window, responses up to a quarter of the budget),
    ``typical`` (5-25 %, a quarter to the whole budget) or ``long`` (the window filled). A
    (row, agent)'s contexts over the steps are prefixes of one history, so shared prefixes form
    as in a run. Every context + response fits ``window`` (default ``rollout.context_window``);
    the action axis is the run's (``rollout.max_new_tokens``); ``steps`` (default the run's
    ``rollout.steps``) of 1 makes every packed unit a single sequence."""
    import numpy as np

    from marft_jax.rl.trajectory import Trajectory
    from marft_jax.sampling.buckets import length_bucket

    r = cfg.rollout
    S, B, N = steps or r.steps, r.rows, cfg.team.num_agents
    W = window or r.context_window
    K = max(r.budget(i) for i in range(N))
    budget = np.minimum(np.array([r.budget(i) for i in range(N)]), max(W // 2, 1))[None]      # [1, N]
    rng = np.random.default_rng(seed)
    lo, hi, alo, ahi = {"short": (0.02, 0.08, 0.0, 0.25), "typical": (0.05, 0.25, 0.25, 1.0),
                        "long": (0.6, 0.8, 1.0, 1.0)}[profile]
    ctx_len = np.zeros((S, B, N), np.int64)
    act_len = np.zeros((S, B, N), np.int64)
    first = rng.integers(max(1, int(lo * W)), max(2, int(hi * W)), (B, N))
    for s in range(S):
        if profile == "long":
            grown = W - budget - rng.integers(0, max(int(budget.max()) // 4, 1), (B, N))
        else:
            grown = first if s == 0 else ctx_len[s - 1] + act_len[s - 1] + 8
        ctx_len[s] = np.clip(grown, 1, W - 1)
        want = rng.integers(np.maximum(1, (alo * budget).astype(int)), np.maximum(2, (ahi * budget).astype(int) + 1),
                            (B, N))
        act_len[s] = np.clip(np.minimum(want, W - ctx_len[s]), 1, K)
    L = length_bucket(int(ctx_len.max()))
    history = rng.integers(2, vocab, (B, N, L)).astype(np.int32)      # a (row, agent)'s growing context
    start = (L - ctx_len)[..., None]
    ctx_valid = np.arange(L)[None, None, None] >= start
    at = np.clip(np.arange(L) - start, 0, L - 1)
    ctx_tokens = np.where(ctx_valid, np.take_along_axis(np.broadcast_to(history, (S, B, N, L)), at, -1), 0)
    act_valid = np.arange(K)[None, None, None] < act_len[..., None]
    act_tokens = np.where(act_valid, rng.integers(2, vocab, (S, B, N, K)), 0).astype(np.int32)
    terminal = np.zeros((S, B), bool)
    terminal[-1] = True
    logp = np.where(act_valid, -1.0, 0.0).astype(np.float32)
    traj = Trajectory(ctx_tokens=ctx_tokens.astype(np.int32), ctx_valid=ctx_valid, act_tokens=act_tokens,
                      act_valid=act_valid, sample_logp=logp, word_count=(act_len // 4 + 1).astype(np.int32),
                      step_mask=np.ones((S, B), bool), terminal=terminal, truncated=np.zeros((S, B), bool),
                      score=rng.random((S, B)).astype(np.float32), agent_score=np.zeros((S, B, N), np.float32),
                      boot_ctx_tokens=np.zeros((B, N, L), np.int32), boot_ctx_valid=np.zeros((B, N, L), bool),
                      budget_clipped=np.zeros((S, B, N), bool), policy_logp=logp,
                      entropy=np.zeros((S, B, N, K), np.float32))
    traj.check()
    return traj


def _abstract(tree):
    from marft_jax.train.memory_plan import abstract

    return abstract(tree)


def training_programs(run: RunModel, lrn, traj, *, label: str, shapes=None,
                      schedules: Sequence[str] | None = None) -> Iterator[Program]:
    """The feature + backup program, the log-prob recompute and the PPO update (one per
    ``ppo.agent_schedule`` in ``schedules``, default the config's; ``concurrent`` is the ``vmap``
    over agents) for trajectory ``traj``, packed by the learner's shape policies (``shapes``:
    ``(features, logprobs, update)`` policies replacing them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marft_jax.models.critic import CriticParams
    from marft_jax.rl import layout, packing
    from marft_jax.rl.update import UpdateBatch, ppo_update
    from marft_jax.train import prepare

    cfg, model, placement = run.config, run.model, run.placement
    mesh = placement.mesh
    acfg = lrn.adv_cfg
    feat_policy, lp_policy, upd_policy = shapes or (lrn.run_state.prepare.features, lrn.run_state.prepare.logprobs,
                                                    lrn.run_state.update)
    S, B, N, L, K = traj.shape
    backup = prepare._upload(placement, jax.tree.map(np.asarray, prepare.backup_inputs(traj)))
    if run.state.critic is None:   # a critic-free estimator: the backup alone
        fn, fargs, fkw = prepare._critic_free_backups, (_abstract(backup),), dict(acfg=acfg)
        yield Program("backup", f"{label}: {S} steps x {B} rows x {N} agents", "algo.advantage, rollout.group_size",
                      fn, fargs, fkw, mesh)
    else:                          # feature pass + backup (prepare_update_batch's device program)
        calls, gather, n_main, _ = prepare.feature_inputs(traj, token_level=acfg.algo.token_level,
                                                          tokens_per_call=acfg.tokens_per_call, policy=feat_policy,
                                                          placement=placement, share=acfg.share_prefixes)
        critic = CriticParams(head=run.state.critic.head, lora=run.state.critic.lora)
        fn, fargs = prepare._values_and_backups, (run.base, critic, _abstract(calls), _abstract(gather), _abstract(backup))
        fkw = dict(cfg=model, acfg=acfg, n_main=n_main)
        classes = packing.format_shape(tuple(c.tokens.shape[-2:] for c in calls))
        yield Program("features+backup", f"{label}: {calls[0].tokens.shape[0]} calls of {classes}",
                      "ppo.share_prefixes, rollout.rows", fn, fargs, fkw, mesh)
    # The recompute forward (ppo.logp_old=recompute): recompute_logprobs' arguments.
    perms = np.arange(B, dtype=np.int32)[None, None]
    packed, _ = packing.pack_update(np.asarray(traj.ctx_tokens), np.asarray(traj.ctx_valid), np.asarray(traj.act_tokens),
                                  np.asarray(traj.act_valid), perms, micro_batches=1, policy=lp_policy,
                                  share=acfg.share_prefixes)
    lp_rows = prepare._place_rows(placement, jax.tree.map(lambda x: x[0, 0], packed.rows), 1)
    actions = prepare._upload(placement, (np.asarray(traj.act_tokens), np.asarray(traj.act_valid)))
    largs = (run.base, run.state.lora, _abstract(lp_rows), _abstract(prepare._upload(placement, packed.gather[0, 0])),
             *_abstract(actions), jnp.float32(cfg.rollout.temperature))
    yield Program("recompute", f"{label}: rows {packing.format_shape(tuple(r.tokens.shape[-2:] for r in lp_rows))}",
                  "ppo.logp_old (sampler skips it)", prepare._packed_logprobs, largs,
                  dict(cfg=model, chunk=acfg.chunk), mesh)
    # The update: the batch prepare_update_batch returns, placed as the learner places it.
    out = fn.trace(*fargs, **(fkw if run.state.critic is None else dict(fkw, cfg=_shape_model(model)))).out_info
    keep_ctx = not lrn.pack_sequences or (run.state.critic is not None and run.state.critic.lora is not None)
    host = jax.tree.map(np.asarray, dict(act_tokens=traj.act_tokens, act_valid=traj.act_valid,
                                         logp=traj.policy_logp, word_count=traj.word_count,
                                         ctx_tokens=traj.ctx_tokens, ctx_valid=traj.ctx_valid))
    batch = UpdateBatch(ctx_tokens=host["ctx_tokens"] if keep_ctx else None,
                        ctx_valid=host["ctx_valid"] if keep_ctx else None,
                        act_tokens=host["act_tokens"], act_valid=host["act_valid"], logp_old=host["logp"],
                        adv=out.adv, ret=None if run.state.critic is None else out.ret,
                        v_old=None if run.state.critic is None else out.value, dp_mask=out.dp, feats=out.feats,
                        word_count=host["word_count"])
    batch = jax.tree.map(lambda x: _rows_struct(placement, x, layout.BATCH_AXIS), batch)
    state = run.state.replace(rng=jax.random.key(cfg.train.seed))
    packed, _ = lrn.pack_update(state, traj, policy=upd_policy)
    if packed is not None:
        _, packed = lrn.place_update(None, packed)
        packed = _abstract(packed)
    rows = "padded" if packed is None else "packed rows " + packing.format_shape(
        tuple(r.tokens.shape[-2:] for r in packed.rows))
    mask, flag = placement.replicate(np.ones((N,), bool)), placement.replicate(np.asarray(True))
    # model.remat=auto on an accelerator: the learner picks the first of these whose memory plan fits
    # (TeamLearner.check_update_memory), so each may be the run's program.
    remats = lrn.run_state.remat_candidates(lrn.update_cfg.remat, accelerator=jax.default_backend() != "cpu")
    for schedule in (cfg.ppo.agent_schedule,) if schedules is None else schedules:
        for remat in remats:
            ppo = dataclasses.replace(lrn.update_cfg.ppo, agent_schedule=schedule)
            ucfg = dataclasses.replace(lrn.update_cfg, ppo=ppo, remat=remat)
            name = "update" if schedule == "sequential" else f"update ({schedule} agents)"
            shape = f"{label}: {rows}" + ("" if len(remats) == 1 else f", remat {remat}")
            yield Program(name, shape, "ppo.micro_batches, model.remat, rollout.rows", ppo_update,
                          (run.base, run.state, batch, mask, flag), dict(cfg=model, ucfg=ucfg, packed=packed), mesh)


def fixed_shape_policies(lrn, traj, row_len: int):
    """``(features, logprobs, update)`` shape policies that pack every sequence of ``traj`` (each
    at most ``row_len`` tokens, one step: no shared-prefix units longer than a sequence) one per
    row into single-class rows of ``row_len`` slots."""
    S, B, N = traj.shape[:3]
    multiple = lrn.run_state.update.row_multiple
    ppo = lrn.update_cfg.ppo

    def fixed(policy, rows: int):
        rows = -(-rows // multiple) * multiple
        return dataclasses.replace(policy, seen=[((rows, row_len),)], reuse_slack=float("inf"))

    shapes = lrn.run_state
    return (fixed(shapes.prepare.features, S * B * N + B * N), fixed(shapes.prepare.logprobs, S * B),
            fixed(shapes.update, S * (B // ppo.num_minibatches) // ppo.micro_batches))


# ------------------------------------------------------------------------------- lowering


@contextlib.contextmanager
def cudnn_assumed():
    """JAX's cuDNN probes answered as on the assumed GPU (:data:`ASSUMED_CUDNN`,
    :data:`ASSUMED_COMPUTE_CAPABILITY`): lowering for ``cuda`` on a machine without CUDA."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    target = tuple(int(x) for x in ASSUMED_COMPUTE_CAPABILITY.split("."))
    saved = {n: getattr(fa, n) for n in ("check_cudnn_version", "check_compute_capability",
                                         "is_cuda_compute_capability_equal")}
    fa.check_cudnn_version = lambda: ASSUMED_CUDNN
    fa.check_compute_capability = lambda c: target >= tuple(int(x) for x in c.split("."))
    fa.is_cuda_compute_capability_equal = lambda c: target == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(fa, n, f)


@contextlib.contextmanager
def as_backend(platform: str):
    """``jax.default_backend()`` answers ``platform``'s backend (``tpu``, ``gpu``) while the run's
    code builds and traces its programs, so every choice it makes by backend (backups, logits
    chunks, kernels, remat) is the target's, not this CPU's. A no-op for ``cpu``. ``jax.jit``
    keeps traces across backends (the backend is no part of its cache key): a process that
    lowers for two platforms calls ``jax.clear_caches()`` between them."""
    import jax

    if platform == "cpu":
        yield
        return
    saved = jax.default_backend
    jax.default_backend = lambda: BACKEND[platform]
    try:
        yield
    finally:
        jax.default_backend = saved


def lower(program: Program, platform: str) -> int | None:
    """Lower ``program`` for ``platform`` (compile it on ``cpu``). Returns the planned bytes
    per device on ``cpu`` (:func:`marft_jax.train.memory_plan.planned_bytes`), else None."""
    import jax

    from marft_jax.train import memory_plan

    ctx = contextlib.nullcontext() if program.mesh is None else jax.set_mesh(program.mesh)
    with ctx, as_backend(platform):
        if platform == "tpu":
            jax.export.export(program.fn, platforms=["tpu"])(*program.args, **program.kwargs)
            return None
        if platform == "cuda":
            with cudnn_assumed():
                program.fn.trace(*program.args, **program.kwargs).lower(lowering_platforms=("cuda",))
            return None
        _, planned = memory_plan.plan_of(program.fn, *program.args, **program.kwargs)
        return planned


def key_to_change(error: BaseException, program: Program) -> str:
    """The config key a failure points at: ``model.attention`` when it comes from an attention
    kernel, the mesh axes for a partitioning error, else the program's own keys."""
    text = "".join(traceback.format_exception(error))
    if any(s in text for s in ("models/attention.py", "pallas", "splash", "cudnn", "Mosaic")):
        return "model.attention (xla lowers everywhere)"
    if "shard" in str(error).lower() or "partition" in str(error).lower():
        return "mesh.data / mesh.fsdp / mesh.tensor"
    return program.keys


@dataclasses.dataclass
class Outcome:
    program: Program
    attention: str
    error: BaseException | None
    planned: int | None
    seconds: float

    def line(self, available: int | None = None) -> str:
        p = self.program
        head = f"{p.name:<24} {p.shape:<52} {self.attention:<7}"
        if self.error is not None:
            msg = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
            return f"FAIL {head} {type(self.error).__name__}: {msg[:300]} -> change {key_to_change(self.error, p)}"
        mem = ""
        if self.planned is not None:
            gib = self.planned / 2 ** 30
            mem = f" {gib:.2f} GiB/device" + (f" of {available / 2 ** 30:.1f}" if available else "")
            if available is not None and self.planned > available:
                return f"FAIL {head} planned{mem}: over the device's memory -> change {p.keys}"
        return f"ok   {head}{mem} ({self.seconds:.1f} s)"


def run_programs(programs: Iterator[Program], platform: str, attention: str, *, stop_at_first: bool = True,
                 emit: Callable[[str], None] = print, available: int | None = None) -> list[Outcome]:
    """Lower each program, emitting one line each; stop at the first failure when asked (also
    for a program building its arguments: that failure is reported as its own line)."""
    outcomes = []
    it = iter(programs)
    while True:
        t0 = time.perf_counter()
        try:
            with as_backend(platform):
                program = next(it)
        except StopIteration:
            break
        except Exception as e:                 # building a program's inputs failed
            program = Program("(building inputs)", "", "see the error", None, (), {})
            outcomes.append(Outcome(program, attention, e, None, time.perf_counter() - t0))
            emit(outcomes[-1].line(available))
            break
        try:
            planned, error = lower(program, platform), None
        except Exception as e:
            planned, error = None, e
        outcomes.append(Outcome(program, attention, error, planned, time.perf_counter() - t0))
        emit(outcomes[-1].line(available))
        if error is not None and stop_at_first:
            break
        if outcomes[-1].planned is not None and available is not None and outcomes[-1].planned > available \
                and stop_at_first:
            break
    return outcomes


PROGRAMS = ("prefill", "decode", "features+backup", "backup", "recompute", "update", "eval")


def all_programs(run: RunModel, *, profiles: Sequence[str] = PROFILES, kernel_lengths: Sequence[int] = KERNEL_LENGTHS,
                 schedules: Sequence[str] | None = None, prompt_lengths: Sequence[int] | None = None,
                 only: Sequence[str] = PROGRAMS) -> Iterator[Program]:
    """Every program of the run (see the module docstring) named in ``only`` (:data:`PROGRAMS`;
    ``eval`` stands for both evaluation programs), in the order a run meets them."""
    cfg = run.config
    lrn = learner(run)
    width = max(len(layer) for layer in lrn.team.topology.layers)
    wanted = lambda p: p.name.split(" ")[0] in only or (p.name.startswith("eval ") and "eval" in only)
    if {"prefill", "decode"} & set(only):
        yield from filter(wanted, sampler_programs(run, lrn, batch=cfg.rollout.rows * width, sampling=cfg.rollout,
                                                   prompt_lengths=prompt_lengths, phases="decode" in only))
    if {"features+backup", "backup", "recompute", "update"} & set(only):
        for profile in profiles:
            traj = synthetic_trajectory(cfg, profile, vocab=run.model.vocab_size)
            yield from filter(wanted, training_programs(run, lrn, traj, label=profile, schedules=schedules))
        for row_len in [t for t in kernel_lengths if t <= cfg.rollout.context_window]:
            traj = synthetic_trajectory(cfg, "long", vocab=run.model.vocab_size, window=row_len, steps=1)
            yield from filter(wanted, training_programs(run, lrn, traj, label=f"rows of {row_len}",
                                                        shapes=fixed_shape_policies(lrn, traj, row_len),
                                                        schedules=schedules))
    if "eval" in only:
        sampling = dataclasses.replace(cfg.rollout, temperature=cfg.train.eval_temperature, top_k=0, top_p=1.0)
        yield from sampler_programs(run, lrn, batch=cfg.train.eval_batch_size * width, sampling=sampling,
                                    label="eval ", prompt_lengths=prompt_lengths)


# ------------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="*", help="[PRESET|FILE.yaml] [key=value ...] (as for train)")
    p.add_argument("--platform", choices=PLATFORMS, required=True,
                   help="tpu or cuda: lower for that accelerator; cpu: compile and print memory plans")
    p.add_argument("--devices", type=int, default=1, help="devices of the run's mesh (simulated here)")
    p.add_argument("--programs", default=None,
                   help="comma-separated program names to lower (default all): prefill, decode, features+backup, "
                        "backup (a critic-free estimator's), recompute, update, eval")


def _rerun_with_devices(args) -> int:
    """Run this command again in a process with ``--devices`` simulated CPU devices."""
    from marft_jax.distributed import simulated_devices_env

    env = simulated_devices_env(args.devices, **{DEVICES_ENV: str(args.devices)})
    argv = [sys.executable, "-m", "marft_jax.cli", "preflight", *args.config, "--platform", args.platform,
            "--devices", str(args.devices)] + (["--programs", args.programs] if args.programs else [])
    return subprocess.call(argv, env=env)


def main(args, load_config: Callable) -> int:
    """``marft-jax preflight``: 0 when every program lowers (and fits, on ``cpu``), 1 at the
    first that does not; ``load_config(items)`` reads the preset and overrides."""
    if args.devices < 1:
        raise PreflightError(f"--devices must be >= 1, got {args.devices}")
    only = PROGRAMS if not args.programs else tuple(w.strip() for w in args.programs.split(",") if w.strip())
    bad = sorted(set(only) - set(PROGRAMS))
    if bad:
        raise PreflightError(f"--programs: unknown program(s) {bad}; choose from {', '.join(PROGRAMS)}")
    on_cpu = os.environ.get("JAX_PLATFORMS") == "cpu"
    if not on_cpu or (args.devices > 1 and os.environ.get(DEVICES_ENV) != str(args.devices)):
        return _rerun_with_devices(args)
    import jax

    from marft_jax.train import memory_plan

    t0 = time.perf_counter()
    cfg = load_config(args.config)
    model, source = model_architecture(cfg.model.name, cfg.model.revision)
    model = resolve_model(cfg, model, args.platform, args.devices)
    run = build(cfg, model, args.devices, args.platform)
    mesh = f"mesh {dict(run.placement.mesh.shape)}"
    print(f"preflight {cfg.preset}: {args.platform} x {args.devices} ({mesh}), model {cfg.model.name} "
          f"({model.num_params() / 1e9:.2f} B parameters, {jax.numpy.dtype(run.dtype).name}) from {source}; "
          f"attention {model.attention}, decode attention {model.decode_attention}, decode matmul {model.decode_matmul}", flush=True)
    available = memory_plan.available_bytes() if args.platform == "cpu" else None
    outcomes = run_programs(all_programs(run, only=only), args.platform, model.attention,
                            emit=lambda s: print(s, flush=True), available=available)
    failed = [o for o in outcomes if o.error is not None or (available and o.planned and o.planned > available)]
    print(f"{'FAILED' if failed else 'all ok'}: {len(outcomes) - len(failed)} of {len(outcomes)} programs "
          f"lowered for {args.platform} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0
