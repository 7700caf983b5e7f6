"""Training metrics: the JSONL + TensorBoard writer, MFU, per-agent names and stage timers.

Names follow the style guide §4 (``perf/throughput``, ``timing_s/<stage>``,
``actor/<agent>/pg_loss``, ``critic/value_loss``, ...).

``metrics.jsonl`` holds one JSON object per logged step, ``{"step": 12, "time": 1.7e9,
"<name>": value, ...}``, appended and flushed line by line. Non-finite floats are written as the
strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has no NaN; ``float()`` reads them back).
On resume, lines with ``step > resume_step`` (and a torn last line) are dropped first, so a
step is never logged twice. TensorBoard event files (tensorboardX, scalars only) go to
``<run_dir>/tb``; on resume the writer sets ``purge_step = resume_step + 1`` so TensorBoard
hides the events of the abandoned steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from marft_jax.train import peaks

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"

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


def _encode(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


def _to_python(v: Any) -> Any:
    if isinstance(v, (np.ndarray, np.generic)):
        return v.item() if v.size == 1 else v.tolist()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_to_python(x) for x in v]
    return str(v)


def _read_lines(path: Path) -> list[dict]:
    """Parse a metrics file, skipping a torn (unparseable) line such as a crash's last write."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            rows.append(rec)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of ``<run_dir>/metrics.jsonl`` in file order (torn lines skipped)."""
    return _read_lines(Path(run_dir) / METRICS_FILE)


class MetricsWriter:
    """Append per-step metrics to ``<run_dir>/metrics.jsonl`` and TensorBoard.

    Args:
      run_dir: the run directory (created).
      tensorboard: also write tensorboardX event files under ``<run_dir>/tb``.
      resume_step: the step of the checkpoint being resumed; records with a larger step are
        removed from ``metrics.jsonl`` (rewritten atomically) and purged in TensorBoard.
      enabled: False on every process but process 0 of a multi-process run: records are built
        and returned, nothing is written.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None,
                 enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._f, self._tb = None, None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            self._truncate(int(resume_step))
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            kw = {"purge_step": int(resume_step) + 1} if resume_step is not None else {}
            self._tb = SummaryWriter(logdir=str(self.run_dir / TB_DIR), **kw)

    def _truncate(self, resume_step: int) -> None:
        if not self.path.is_file():
            return
        keep = [r for r in _read_lines(self.path) if int(r["step"]) <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Log one step. Values may be Python/NumPy scalars or JAX arrays (fetched in one sync);
        size-1 arrays become scalars, larger ones JSON lists (not sent to TensorBoard).
        Returns the record written."""
        host = jax.device_get(dict(metrics))
        rec: dict[str, Any] = {"step": int(step), "time": time.time()}
        for k, v in host.items():
            if k in ("step", "time"):
                raise ValueError(f"metric name {k!r} is reserved")
            rec[str(k)] = _to_python(v)
        if not self.enabled:
            return rec
        self._f.write(json.dumps({k: _encode(v) for k, v in rec.items()}, sort_keys=True, allow_nan=False) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k in ("step", "time") or isinstance(v, (bool, str, list)) or v is None:
                    continue
                self._tb.add_scalar(k, float(v), int(step))
            self._tb.flush()
        return rec

    def close(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

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
