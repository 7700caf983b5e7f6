"""The training run: evaluation before and after, the iteration loop, logging, checkpoints.

``train(cfg)`` creates (or resumes) ``<out_dir>/<run_name>/`` holding ``config.yaml``,
``metrics.jsonl`` + TensorBoard events, ``checkpoints/step_<N>/``, ``eval/*.json`` and
``plots/*.png``. Resuming from step k replays steps k+1… exactly as the uninterrupted run
(the sampling key of iteration i is ``fold_in(seed_key, i)``, the update's RNG and the data
position are in the checkpoint). SIGINT/SIGTERM finish the current iteration, write a final
checkpoint and exit; a non-finite loss skips that update (logged) and never reaches a
checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import math
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from marft_jax.config import Config, to_dict, to_yaml
from marft_jax.envs.task import Problem, Task
from marft_jax.profiling import StepProfiler
from marft_jax.rl.state import TrainState
from marft_jax.train.build import Run, build_run, check_names, fresh_state
from marft_jax.train.checkpoint import CheckpointManager, nonfinite_leaves
from marft_jax.train.evaluate import EvalResult, evaluate
from marft_jax.train.hosts import ProcessRows
from marft_jax.train.metric_sinks import require_installed
from marft_jax.train.metrics import MetricsWriter
from marft_jax.train.run_state import CHECKPOINT_KEY as RUN_STATE_KEY


class ProblemStream:
    """Endless, seeded stream of training problems; ``position`` = problems consumed so far
    (by all processes together).

    Pass p of the split uses order ``task.problems("train", seed + p)``. ``rows``: with several
    processes, :meth:`take` returns this process's contiguous block of the next ``n`` problems
    (:meth:`~marft_jax.train.hosts.ProcessRows.bounds`); the processes' blocks are disjoint
    and cover the batch, and the position (saved with checkpoints) counts all ``n``, so a
    resumed run draws the same blocks.
    """

    def __init__(self, task: Task, seed: int, position: int = 0, rows: ProcessRows | None = None):
        self.task, self.seed = task, seed
        self.rows = rows or ProcessRows()
        self.position = 0
        self._pass = 0
        self._it = iter(task.problems("train", seed))
        for _ in range(position):
            self._next()

    def _next(self) -> Problem:
        try:
            p = next(self._it)
        except StopIteration:
            self._pass += 1
            self._it = iter(self.task.problems("train", self.seed + self._pass))
            try:
                p = next(self._it)
            except StopIteration:
                raise ValueError(f"task {self.task.name!r} has no training problems") from None
        self.position += 1
        return p

    def take(self, n: int, group_size: int = 1) -> list[Problem]:
        """This process's rows of a batch of ``n`` (all ``n`` on one process): the next
        ``n / group_size`` problems, each repeated ``group_size`` times in consecutive rows (the
        groups ``algo.advantage=group`` baselines)."""
        lo, hi = self.rows.bounds(n)
        # a task's order is an iterator: every problem is drawn
        drawn = [p for p in (self._next() for _ in range(n // group_size)) for _ in range(group_size)]
        return drawn[lo:hi]


def run_dir_for(cfg: Config) -> Path:
    name = cfg.train.run_name or f"{cfg.preset}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.train.out_dir) / name


def _finite(metrics: dict) -> bool:
    return all(math.isfinite(v) for v in metrics.values() if isinstance(v, (int, float)))


class _StopFlag:
    """SIGINT/SIGTERM set the flag; the loop checkpoints and exits after the current iteration."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\nreceived signal {signum}: finishing this iteration, then saving a checkpoint", file=sys.stderr)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _eval_and_save(run: Run, state: TrainState, problems, cfg: Config, run_dir: Path, tag: str,
                   seeds=(0,), temperature=None) -> EvalResult:
    res = evaluate(run.learner, state, problems, seeds=list(seeds),
                   temperature=cfg.train.eval_temperature if temperature is None else temperature,
                   batch_size=cfg.train.eval_batch_size)
    if not is_primary():
        return res
    # eval/before.json and eval/after.json feed `marft-jax table`; periodic ones stay apart.
    out = run_dir / "eval" if tag in ("before", "after") else run_dir / "eval" / "periodic"
    out.mkdir(parents=True, exist_ok=True)
    fields = method_fields(cfg)
    if tag == "before":
        fields["method"] = untrained_method(cfg)
    doc = {"tag": tag, "benchmark": run.task.name, "problems": len(problems),
           "temperature": cfg.train.eval_temperature if temperature is None else temperature,
           **fields, "seeds": res.team, **res.summary(), "examples": res.examples}
    (out / f"{tag}.json").write_text(json.dumps(doc, indent=2, default=str))
    return res


def is_primary() -> bool:
    """Process 0 writes logs, evaluations, plots and summaries (every process computes them)."""
    return jax.process_index() == 0


def untrained_method(cfg: Config) -> str:
    """The table's name of the untrained team a run starts from: the base model with the run's
    prompts. Chained and parallel teams see different prompts (agent i reads agents < i, or
    only the task), so they are different rows; MARFT-A and MARFT-T share theirs."""
    if cfg.team.num_agents == 1:
        return "untrained base (single-agent prompt)"
    parallel = cfg.rollout.mode == "parallel" or cfg.team.graph == "independent"
    return f"untrained base ({'parallel' if parallel else 'chained'} team prompts)"


def method_fields(cfg: Config) -> dict:
    """How the table groups a run: method, agents, roles (and the graph when not the default);
    ``independent``: every agent answers alone (the table reports the mean over agents)."""
    if cfg.team.num_agents == 1:
        method = "single agent (PPO-" + ("A" if cfg.algo.level == "action" else "T") + ")"
    elif cfg.rollout.mode == "parallel" or cfg.team.graph == "independent":
        method = "independent PPO"
    else:
        method = "MARFT-A" if cfg.algo.level == "action" else "MARFT-T"
        if cfg.team.graph not in (None, "chain"):
            method += f" ({cfg.team.graph})"
    return {"method": method, "agents": cfg.team.num_agents,
            "roles": "anonymous" if "anonymous" in cfg.team.profile else "named",
            "independent": cfg.team.num_agents > 1 and (cfg.rollout.mode == "parallel"
                                                       or cfg.team.graph == "independent")}


def _progress(total: int, initial: int):
    if sys.stdout.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="it", dynamic_ncols=True)
    return None


def train(cfg: Config, *, resume: bool = True, stop_after: int | None = None) -> dict:
    """Run (or resume) training; returns a summary dict (accuracies, paths).

    Args:
      cfg: the validated config.
      resume: continue from the newest valid checkpoint in the run directory, if any.
      stop_after: stop after this many iterations of *this* invocation (tests simulate a kill).
    """
    check_names(cfg)
    require_installed(cfg.train.loggers)   # a missing wandb is a config error before any work
    run_dir = run_dir_for(cfg)
    run = build_run(cfg)                  # starts jax.distributed first where the run has processes
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if is_primary():
            cfg_text = to_yaml(cfg)
            cfg_file = run_dir / "config.yaml"
            if cfg_file.exists() and cfg_file.read_text() != cfg_text:
                cfg_file = run_dir / f"config-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.yaml"
            cfg_file.write_text(cfg_text)
        return _train(cfg, run, run_dir, resume, stop_after)
    finally:
        run.close()


@dataclasses.dataclass
class _Progress:
    """Where a run stands: the next iteration, the data stream's position, the environment
    samples so far and the held-out accuracy before training (None: not evaluated yet)."""

    iteration: int = 0
    position: int = 0
    env_samples: int = 0
    before: float | None = None


def _restore(ckpt: CheckpointManager, state: TrainState, learner) -> tuple[TrainState, _Progress, int | None]:
    """The latest checkpoint's state and progress, and the learner's run state restored from it;
    ``(state, _Progress(), None)`` when there is none. The last value is the restored step."""
    if not ckpt.all_steps():
        return state, _Progress(), None
    state, extra = ckpt.restore(target_state=state)
    progress = _Progress(int(extra["iteration"]), int(extra["data_position"]), int(extra["env_samples"]),
                         extra.get("eval_before"))
    learner.run_state.restore(extra)      # context bucket, packed shapes, remat choice
    print(f"resumed from {ckpt.step_path(progress.iteration)} (iteration {progress.iteration})")
    return state, progress, progress.iteration


def _guarded_iteration(learner, state: TrainState, problems, *, it: int, env_samples: int, key,
                       on_stage) -> tuple[TrainState, dict, object, bool]:
    """One learner iteration; a non-finite loss or state keeps the state from before it (the
    update donates ``state``, so a copy is kept). Returns ``(state, metrics, texts, skipped)``;
    a skipped iteration's metrics hold only its finite numbers."""
    backup = jax.tree.map(jnp.copy, state)
    state, m, texts = learner.iteration(state, problems, iteration=it, env_samples=env_samples, key=key,
                                        on_stage=on_stage)
    if _finite(m) and not nonfinite_leaves(state):
        return state, m, texts, False
    m = {k: v for k, v in m.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    print(f"iteration {it + 1}: non-finite loss or parameters, update skipped", file=sys.stderr)
    return backup, m, texts, True


def _stop_before(cfg: Config, it: int, start: int, stop_after: int | None, elapsed_s: float,
                 last_step_s: float) -> str | None:
    """Why the loop stops before iteration ``it`` (None: it runs): ``done``, ``stop_after`` or
    ``budget`` (an iteration expected, from the last one, to end past ``train.time_budget_s``)."""
    if it >= cfg.train.iterations:
        return "done"
    if stop_after is not None and it - start >= stop_after:
        return "stop_after"
    if cfg.train.time_budget_s and elapsed_s + last_step_s > cfg.train.time_budget_s:
        return "budget"
    return None


def _train(cfg: Config, run: Run, run_dir: Path, resume: bool, stop_after: int | None) -> dict:
    learner = run.learner
    untrained = fresh_state(cfg, run.model.cfg)
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.train.keep_last, async_save=True)
    # saved_at: the step whose checkpoint holds `state` (not saved again: orbax cannot overwrite in place)
    state, progress, saved_at = _restore(ckpt, untrained, learner) if resume else (untrained, _Progress(), None)
    start = progress.iteration
    state = learner.place_state(state)
    sink_options = {"wandb": {**dataclasses.asdict(cfg.train.wandb), "config": to_dict(cfg)}}
    writer = MetricsWriter(run_dir, cfg.train.loggers, resume_step=start if start else None, enabled=is_primary(),
                           options=sink_options)
    stream = ProblemStream(run.task, cfg.train.seed, progress.position, rows=learner.rows)
    eval_problems = list(itertools.islice(run.task.problems("test", 0), cfg.train.eval_problems))
    if not eval_problems:
        raise ValueError(f"task {run.task.name!r} has no test problems for evaluation")

    if progress.before is None and cfg.train.eval_before:
        # A run resumed past iteration 0 whose first part skipped this evaluation: the untrained
        # team is the initial state (a function of the seed), not the restored one.
        t_eval = time.perf_counter()
        res = _eval_and_save(run, state if start == 0 else learner.place_state(untrained), eval_problems, cfg,
                             run_dir, "before")
        progress.before = res.mean
        print(f"accuracy before training: {res.mean:.3f} on {len(eval_problems)} held-out problems "
              f"({time.perf_counter() - t_eval:.0f}s)")
    del untrained
    t_start = time.perf_counter()       # the time budget counts training only
    seed_key = jax.random.key(cfg.train.seed + 1)
    bar = _progress(cfg.train.iterations, start)
    it, skipped, stop, last_step_s = start, 0, None, 0.0
    last_metrics: dict = {}
    overflow_noted = False   # the first iteration whose contexts outgrew the window has been reported
    logged = start           # the last iteration whose metrics went to the sinks (train.log_every)

    def save(i: int) -> None:
        nonlocal saved_at
        if i == saved_at:
            return
        extra = {"iteration": i, "data_position": stream.position, "env_samples": progress.env_samples,
                 "eval_before": progress.before, RUN_STATE_KEY: learner.run_state.to_json(),
                 "metrics": last_metrics}
        if ckpt.save(i, state, extra, force=True):
            saved_at = i
        else:
            print(f"checkpoint at iteration {i} refused (non-finite state); previous checkpoints kept",
                  file=sys.stderr)

    prof = cfg.train.profile
    profiler = StepProfiler(prof.start, prof.steps, prof.dir or run_dir / "profile")
    with _StopFlag() as flag, contextlib.closing(profiler):
        while flag.signal is None:
            stop = _stop_before(cfg, it, start, stop_after, time.perf_counter() - t_start, last_step_s)
            if stop is not None:
                break
            t_step = time.perf_counter()
            on_stage = None
            if it == start:   # the first iteration compiles every program: show its stages as they end
                print(f"iteration {it + 1}: first of this run, compiling as it goes ...", flush=True)
                on_stage = lambda name, s: print(f"  {name}: {s:.1f}s", flush=True)
            profiler.before(it)
            state, m, texts, was_skipped = _guarded_iteration(
                learner, state, stream.take(cfg.rollout.rows, cfg.rollout.group_size), it=it,
                env_samples=progress.env_samples, key=jax.random.fold_in(seed_key, it), on_stage=on_stage)
            profiler.after(it)
            overflow_noted = overflow_noted or _note_overflow(cfg, texts, it)
            if was_skipped:
                skipped += 1
                m["train/nonfinite_skipped"] = skipped
            progress.env_samples = int(m.get("env_samples", progress.env_samples))
            last_step_s = time.perf_counter() - t_step
            it += 1
            last_metrics = {k: v for k, v in m.items() if isinstance(v, (int, float))}
            if it % cfg.train.log_every == 0 or it == start + 1:
                writer.write(it, last_metrics)
                logged = it
            _report(bar, it, cfg.train.iterations, m, t_start)
            if cfg.train.eval_every and it % cfg.train.eval_every == 0 and it < cfg.train.iterations:
                res = _eval_and_save(run, state, eval_problems, cfg, run_dir, f"iter{it:06d}")
                writer.write(it, {"eval/accuracy": res.mean})
            if cfg.train.save_every and it % cfg.train.save_every == 0:   # 0: the final checkpoint only
                save(it)
    if stop == "budget":
        print(f"time budget of {cfg.train.time_budget_s:.0f}s reached after {it} iterations")
    if bar is not None:
        bar.close()
    if last_metrics and logged != it:   # the run stopped between two train.log_every iterations
        writer.write(it, last_metrics)
    save(it)
    ckpt.wait()
    summary = {"run_dir": str(run_dir), "iterations": it, "accuracy_before": progress.before,
               "checkpoint": str(ckpt.step_path(it)), "metrics": str(run_dir / "metrics.jsonl"),
               "interrupted": flag.signal is not None, "nonfinite_skipped": skipped,
               "independent": method_fields(cfg)["independent"]}   # accuracies: the mean over agents
    if stop in ("done", "budget") and flag.signal is None:
        res = _eval_and_save(run, state, eval_problems, cfg, run_dir, "after")
        summary["accuracy_after"] = res.mean
        writer.write(it, {"eval/accuracy": res.mean})
    writer.close()
    ckpt.close()
    if is_primary():
        _finish(run_dir, summary)
    return summary


def _finish(run_dir: Path, summary: dict) -> None:
    """The run's plots (a failure is reported, never raised) and ``summary.json``."""
    try:
        from marft_jax.train.plot import plot_run

        summary["plots"] = [str(p) for p in plot_run(run_dir)]
    except Exception as e:  # plotting never fails a run
        summary["plots"] = []
        print(f"plotting failed: {e}", file=sys.stderr)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _note_overflow(cfg: Config, texts, it: int) -> bool:
    """Say (once per run) that this iteration's contexts outgrew ``rollout.context_window`` and
    what ``rollout.overflow`` did; True when there was something to say."""
    truncated, ended = getattr(texts, "overflow_truncated", 0), getattr(texts, "overflow_ended", 0)
    if not (truncated or ended):
        return False
    if is_primary():
        did = ", ".join([f"{truncated} prompt(s) dropped their oldest turns"] * bool(truncated)
                        + [f"{ended} episode(s) ended early (truncated, bootstrapped)"] * bool(ended))
        print(f"iteration {it + 1}: contexts outgrew rollout.context_window={cfg.rollout.context_window}: {did} "
              f"(rollout.overflow={cfg.rollout.overflow}; reported once per run)", flush=True)
    return True


def _report(bar, it: int, total: int, m: dict, t_start: float) -> None:
    acc = m.get("episode/accuracy", float("nan"))
    tps = m.get("perf/throughput", float("nan"))
    if bar is not None:
        bar.set_postfix(reward=f"{m.get('episode/score_mean', float('nan')):.3f}", acc=f"{acc:.3f}",
                        tok_s=f"{tps:.0f}")
        bar.update(1)
        return
    elapsed = time.perf_counter() - t_start
    eta = elapsed / max(it, 1) * (total - it)
    print(f"iter {it}/{total} reward {m.get('episode/score_mean', float('nan')):.3f} acc {acc:.3f} "
          f"tok/s {tps:.0f} step {m.get('timing_s/step', 0):.1f}s eta {eta:.0f}s", flush=True)
