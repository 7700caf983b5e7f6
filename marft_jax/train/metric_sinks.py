"""Where logged metrics go: the sink protocol and its JSONL, TensorBoard and W&B sinks.

:class:`~marft_jax.train.metrics.MetricsWriter` builds one host record per logged step,
``{"step": 12, "time": 1.7e9, "<name>": value, ...}`` (Python scalars, strings or lists), and
hands it to each sink that ``train.loggers`` names. A sink has two methods:
``write(step, record)`` and ``close()``. Add one by writing a class with those methods, built as
``Sink(run_dir, resume_step, **options)``, and naming it in :data:`SINKS`.

``jsonl`` is the source of truth, so ``train.loggers`` must name it: ``metrics.jsonl`` holds one
JSON object per logged step, appended and flushed line by line. Non-finite floats are written as
the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has no NaN; ``float()`` reads them
back). On resume, lines with ``step > resume_step`` (and a torn last line) are dropped first, so a
step is never logged twice. The plots, ``marft-jax table`` and the tests read this file.

``tensorboard`` writes tensorboardX event files (scalars only) to ``<run_dir>/tb``; on resume it
sets ``purge_step = resume_step + 1`` so TensorBoard hides the events of the abandoned steps.

``wandb`` (``pip install 'marft-jax[wandb]'``) logs the same scalars to a Weights & Biases run,
offline unless asked otherwise, so it needs neither a network nor a login; ``wandb sync
<dir>/wandb/offline-run-*`` uploads a run later. A resumed training run starts a new W&B run
(same name) at the resumed step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from marft_jax.config import ConfigError

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
RESERVED = ("step", "time")           # record keys every sink gets that are not metrics
WANDB_MODES = ("offline", "online", "disabled")


class MetricSink(Protocol):
    """One destination of the per-step records (opened for a run directory)."""

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        """Log ``record`` (``step``, ``time`` and the metrics, host values) as step ``step``."""

    def close(self) -> None:
        """Flush and release the destination; called once, at the end of the run."""


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics of a record as floats (no ``step``/``time``, strings, lists or None)."""
    return {k: float(v) for k, v in record.items()
            if k not in RESERVED and not isinstance(v, (bool, str, list)) and v is not None}


def _encode(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


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


class JsonlSink:
    """``<run_dir>/metrics.jsonl``: one JSON line per record, flushed as written; on resume,
    records after ``resume_step`` are removed first (the file is rewritten atomically)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = run_dir / METRICS_FILE
        if resume_step is not None:
            self._truncate(int(resume_step))
        self._f = open(self.path, "a", encoding="utf-8")

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

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._f.write(json.dumps({k: _encode(v) for k, v in record.items()}, sort_keys=True, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class TensorBoardSink:
    """tensorboardX scalars under ``<run_dir>/tb``; on resume the steps after ``resume_step``
    are purged (``purge_step``)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        from tensorboardX import SummaryWriter

        kw = {"purge_step": int(resume_step) + 1} if resume_step is not None else {}
        self._tb = SummaryWriter(logdir=str(run_dir / TB_DIR), **kw)

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        for k, v in scalars(record).items():
            self._tb.add_scalar(k, v, int(step))
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


def wandb_mode(mode: str | None) -> str:
    """The W&B mode to run in: ``mode``, else ``$WANDB_MODE``, else ``offline`` (never online
    unless asked)."""
    return mode or os.environ.get("WANDB_MODE") or "offline"


class WandbSink:
    """A Weights & Biases run (``wandb.init``), offline by default; each record's scalars are
    logged at its step and the run is finished on close.

    Args:
      run_dir: the run directory: the default ``dir`` (W&B writes ``<dir>/wandb/``) and ``name``.
      project, name, dir, mode: ``wandb.init`` arguments (``train.wandb.*``); ``mode`` None
        reads ``$WANDB_MODE`` and falls back to ``offline``.
      config: the run's config, recorded with the W&B run.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, *, project: str = "marft-jax",
                 name: str | None = None, dir: str | None = None, mode: str | None = None,
                 config: Mapping[str, Any] | None = None):
        import wandb

        out = Path(dir) if dir else run_dir
        out.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name or run_dir.name, dir=str(out), mode=wandb_mode(mode),
                               config=dict(config) if config is not None else None)

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._run.log(scalars(record), step=int(step))

    def close(self) -> None:
        self._run.finish()


SINKS: dict[str, type] = {"jsonl": JsonlSink, "tensorboard": TensorBoardSink, "wandb": WandbSink}
DEFAULT_LOGGERS = ("jsonl", "tensorboard")
_EXTRAS = {"wandb": "wandb"}          # sinks whose package comes with a pip extra: name -> extra


def logger_problem(loggers: Sequence[str]) -> str | None:
    """What is wrong with a ``train.loggers`` list (unknown or repeated names, no ``jsonl``), or None."""
    unknown = [n for n in loggers if n not in SINKS]
    if unknown:
        return f"names from {list(SINKS)}; unknown: {unknown}"
    if len(set(loggers)) != len(loggers):
        return "names without repeats"
    if "jsonl" not in loggers:
        return "a list that includes jsonl (the metrics file the plots, tables and resume read)"
    return None


def check_loggers(loggers: Sequence[str], wandb_mode: str | None = None) -> None:
    """Raise :class:`~marft_jax.config.ConfigError` naming ``train.loggers`` (:func:`logger_problem`)
    or ``train.wandb.mode`` (:data:`WANDB_MODES` or None) for a value the sinks cannot take
    (called at build: ``train.build.check_names``)."""
    problem = logger_problem(loggers)
    if problem is not None:
        raise ConfigError(f"train.loggers={loggers!r}: must be {problem}")
    if wandb_mode is not None and wandb_mode not in WANDB_MODES:
        raise ConfigError(f"train.wandb.mode={wandb_mode!r}: must be one of {list(WANDB_MODES)} or null "
                          "($WANDB_MODE, else offline)")


def require_installed(loggers: Sequence[str], key: str = "train.loggers") -> None:
    """Raise :class:`~marft_jax.config.ConfigError` naming ``key`` and the pip extra when a named
    sink's package is missing (call at start-up, before any work)."""
    for name in loggers:
        extra = _EXTRAS.get(name)
        if extra is None:
            continue
        try:
            __import__(name)
        except ImportError as e:
            raise ConfigError(f"{key} names {name!r} but the {name} package is not installed: "
                              f"pip install 'marft-jax[{extra}]' (or drop {name} from {key})") from e


def open_sinks(loggers: Sequence[str], run_dir: str | Path, resume_step: int | None = None,
               options: Mapping[str, Mapping[str, Any]] | None = None) -> list[MetricSink]:
    """Open the sinks named in ``loggers`` for ``run_dir`` (created), in order.

    ``options``: keyword arguments per sink name (``{"wandb": {"project": ..., "mode": ...}}``).
    """
    problem = logger_problem(loggers)
    if problem is not None:
        raise ValueError(f"loggers={list(loggers)!r}: must be {problem}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    options = options or {}
    sinks: list[MetricSink] = []
    try:
        for name in loggers:
            sinks.append(SINKS[name](run_dir, resume_step, **options.get(name, {})))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
