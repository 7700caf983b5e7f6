"""Training metrics: the per-step writer, MFU, per-agent names and stage timers.

Names are ``<area>/<name>`` paths (``perf/throughput``, ``timing_s/<stage>``,
``actor/<agent>/pg_loss``, ``critic/value_loss``, ...).

:class:`MetricsWriter` turns each step's metrics into one host record and hands it to the
sinks that ``train.loggers`` names (:mod:`marft_jax.train.metric_sinks`: ``metrics.jsonl``,
required; TensorBoard under ``<run_dir>/tb``; W&B, offline, with the ``wandb`` extra). That module
documents the file format and what each sink does on resume.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from marft_jax.train import peaks
from marft_jax.train.metric_sinks import DEFAULT_LOGGERS, RESERVED, MetricSink, open_sinks
from marft_jax.train.metric_sinks import METRICS_FILE, TB_DIR, read_metrics  # noqa: F401  (read here by plot.py, tests)

def device_peak_flops(device: Any | None = None) -> float | None:
    """Datasheet dense bf16 FLOP/s of ``device`` (default: the first device), or None when its
    kind is not in :data:`marft_jax.train.peaks.PEAKS` (CPU: see :func:`~marft_jax.train.peaks.device_peak`)."""
    device = device if device is not None else jax.devices()[0]
    peak = peaks.table_peak(str(getattr(device, "device_kind", "")))
    return None if peak is None else peak.flops_bf16


def mfu(flops: float, seconds: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``flops / (seconds * devices * peak_flops)``.

    ``flops`` counts the *model* FLOPs of the step's training passes (not recomputation from
    remat, not the sampler): with ``F = ModelConfig.flops_per_token(context)`` (forward, 2 per
    MAC) and ``T`` tokens through each pass, a forward-only pass (old log-probs, critic values)
    costs ``F·T`` and a LoRA training pass ``≈ 2·F·T`` (forward + activation gradients through the
    frozen base; the adapters' own weight gradients are negligible), against ``3·F·T`` for full
    fine-tuning. ``peak_flops``: per-device peak FLOP/s for the training dtype
    (:func:`device_peak_flops`). Returns a fraction in [0, 1] (0 when an input is not positive).
    """
    if seconds <= 0 or devices <= 0 or peak_flops <= 0:
        return 0.0
    return float(flops) / (float(seconds) * int(devices) * float(peak_flops))


def utilisation_metrics(cfg, dtype, *, step_s: float, update_s: float, context_mean: float,
                        rollout_tokens: int, rollout_head_tokens: int, prepare_tokens: int,
                        update_tokens: int, update_head_tokens: int, happo_passes: float,
                        prepare_head_tokens: int = 0, sampler: Any | None = None,
                        device: Any | None = None, num_devices: int = 1) -> dict[str, float]:
    """``perf/mfu``, ``perf/mfu/update``, ``perf/hbm_bw_util`` (decode) and peak memory of one
    iteration.

    Model FLOPs, per valid token: ``B = cfg.flops_per_token(context_mean / 2)`` minus the LM
    head through the decoder blocks, plus the head (``2 H V``) only where logits are formed. The
    rollout's prompts and generated tokens pass the blocks once and the generated ones the head;
    the feature pass's tokens the blocks once (the head only for recomputed old log-probs:
    ``prepare_head_tokens``); the update's tokens ``(2 + happo_passes)`` times (LoRA training
    pass = forward + activation gradients, plus HAPPO's extra forwards; remat recompute is not
    model work), its action tokens the head as often. Peaks come from
    :func:`marft_jax.train.peaks.device_peak` (datasheet, or measured on CPU: then
    ``perf/peak_measured`` is 1). ``sampler``: the rollout's
    :class:`~marft_jax.sampling.sampler.SamplerTotals` (decode bytes and seconds).
    ``num_devices``: the devices the iteration ran on (the mesh's size). Peaks are per device,
    so both figures divide by it: ``perf/mfu`` is the model FLOPs over ``num_devices`` x the peak
    FLOP/s, and ``perf/hbm_bw_util`` the decode bytes summed over the devices (replicated
    weights once per device, the split cache once: :func:`~marft_jax.sampling.sampler.device_bytes`)
    over ``num_devices`` x the peak bandwidth.
    """
    peak = peaks.device_peak(device)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    body = float(cfg.flops_per_token(int(context_mean // 2))) - head
    passes = 2.0 + happo_passes
    upd = passes * (body * update_tokens + head * update_head_tokens)
    total = (body * (rollout_tokens + prepare_tokens) + head * (rollout_head_tokens + prepare_head_tokens)) + upd
    flops = peak.flops(dtype)
    out = {"perf/mfu": mfu(total, step_s, num_devices, flops),
           "perf/mfu/update": mfu(upd, update_s, num_devices, flops),
           "perf/model_flops": total, "perf/peak_measured": float(peak.source == "measured"),
           "perf/peak_host_rss_bytes": float(peaks.peak_host_rss_bytes())}
    if sampler is not None and sampler.decode_s > 0:
        out["perf/hbm_bw_util"] = sampler.decode_bytes / sampler.decode_s / (num_devices * peak.hbm_bytes_per_s)
        out["timing_s/rollout/prefill"] = sampler.prefill_s
        out["timing_s/rollout/decode"] = sampler.decode_s
    mem = peaks.peak_device_memory_bytes(device)
    if mem is not None:
        out["perf/peak_device_memory_bytes"] = float(mem)
    return out


def role_names(num_agents: int, roles: Sequence[str] | None = None) -> list[str]:
    """The ``<agent>`` part of metric names: the configured role names, or ``agent0``, ``agent1``..."""
    if roles is None:
        return [f"agent{i}" for i in range(num_agents)]
    roles = [str(r) for r in roles]
    if len(roles) != num_agents:
        raise ValueError(f"{len(roles)} role names for {num_agents} agents")
    if len(set(roles)) != len(roles):
        raise ValueError(f"role names must be unique for metric names, got {roles}")
    bad = [r for r in roles if not r or "/" in r]
    if bad:
        raise ValueError(f"role names must be non-empty and contain no '/', got {bad}")
    return roles


def per_agent(prefix: str, values: Mapping[str, Any], roles: Sequence[str]) -> dict[str, float]:
    """``{"pg_loss": [N] array}`` -> ``{"<prefix>/<role>/pg_loss": float}`` (one host sync).

    Example: ``per_agent("actor", {"pg_loss": l, "clip_frac": c}, ["planner", "coder"])`` gives
    ``actor/planner/pg_loss``, ``actor/coder/pg_loss``, ``actor/planner/clip_frac``, ...
    """
    host = jax.device_get(dict(values))
    out: dict[str, float] = {}
    for name, arr in host.items():
        arr = np.asarray(arr)
        if arr.shape != (len(roles),):
            raise ValueError(f"per_agent: {prefix}/{name} has shape {arr.shape}, want [{len(roles)}] (one per agent)")
        for role, v in zip(roles, arr.tolist()):
            out[f"{prefix}/{role}/{name}"] = float(v)
    return out


def _to_python(v: Any) -> Any:
    if isinstance(v, (np.ndarray, np.generic)):
        return v.item() if v.size == 1 else v.tolist()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_to_python(x) for x in v]
    return str(v)


class MetricsWriter:
    """Log per-step metrics to the run's sinks (``metrics.jsonl`` first).

    Args:
      run_dir: the run directory (created).
      loggers: the sink names (``train.loggers``): ``jsonl`` (required), ``tensorboard``,
        ``wandb``; see :mod:`marft_jax.train.metric_sinks`.
      resume_step: the step of the checkpoint being resumed; records with a larger step are
        removed from ``metrics.jsonl`` (rewritten atomically) and purged in TensorBoard.
      enabled: False on every process but process 0 of a multi-process run: records are built
        and returned, no sink is opened and nothing is written.
      options: keyword arguments per sink name, e.g. ``{"wandb": {"project": "p", "mode": "offline"}}``.
    """

    def __init__(self, run_dir: str | Path, loggers: Sequence[str] = DEFAULT_LOGGERS,
                 resume_step: int | None = None, enabled: bool = True,
                 options: Mapping[str, Mapping[str, Any]] | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.sinks: list[MetricSink] = open_sinks(loggers, self.run_dir, resume_step, options) if enabled else []

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Log one step. Values may be Python/NumPy scalars or JAX arrays (fetched in one sync);
        size-1 arrays become scalars, larger ones JSON lists (not sent to TensorBoard or W&B).
        Returns the record written."""
        host = jax.device_get(dict(metrics))
        rec: dict[str, Any] = {"step": int(step), "time": time.time()}
        for k, v in host.items():
            if k in RESERVED:
                raise ValueError(f"metric name {k!r} is reserved")
            rec[str(k)] = _to_python(v)
        for sink in self.sinks:
            sink.write(int(step), rec)
        return rec

    def close(self) -> None:
        """Close every sink (once; later calls do nothing)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Timer:
    """Time a stage into ``sink["timing_s/<stage>"]`` (seconds, accumulated over repeats).

    Async dispatch returns before the device finishes, so hand the stage's output to
    :meth:`ready` (or ``block_on=``): it is passed to ``jax.block_until_ready`` before the clock
    stops. Example::

        times = {}
        with Timer("rollout", times) as t:
            traj = t.ready(rollout(params, batch))
    """

    def __init__(self, stage: str, sink: dict | None = None, block_on: Any = None):
        self.name = stage if stage.startswith("timing_s/") else f"timing_s/{stage}"
        self.sink = sink if sink is not None else {}
        self._value = block_on
        self.seconds = 0.0

    def ready(self, value: Any) -> Any:
        """Mark ``value`` as the stage's output (blocked on at exit); returns it unchanged."""
        self._value = value
        return value

    def __enter__(self) -> "Timer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._value is not None:
            jax.block_until_ready(self._value)
        self._value = None
        self.seconds = time.perf_counter() - self._t0
        self.sink[self.name] = self.sink.get(self.name, 0.0) + self.seconds
