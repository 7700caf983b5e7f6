"""``marft-jax``: train, eval, generate, bench, table, plot, preflight.

Every subcommand has ``--help``. Configs are presets (``experiments/configs``) or YAML files
plus ``key=value`` overrides, e.g. ``marft-jax train demo ppo.epochs=2 train.iterations=10``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

# Hub access follows the environment (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN): models and datasets
# named org/name are fetched into the Hugging Face cache unless HF_HUB_OFFLINE=1 (marft_jax.hub).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EPILOG = "Config overrides are dotted key=value pairs (see docs/configuration.md)."


def _split_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    preset = None
    overrides = []
    for x in items:
        if "=" in x:
            overrides.append(x)
        elif preset is None:
            preset = x
        else:
            raise SystemExit(f"error: unexpected argument {x!r} (only one preset; overrides look like key=value)")
    return preset, overrides


def _load(items: list[str], default: str | None):
    from marft_jax.config import load_config
    from marft_jax.train.build import check_names

    preset, overrides = _split_overrides(items)
    cfg = check_names(load_config(preset or default, overrides))   # ConfigError: exit status 2 (main)
    if preset or default:
        from dataclasses import replace

        cfg = replace(cfg, preset=Path(preset or default).stem if cfg.preset == "default" else cfg.preset)
    return cfg


def cmd_train(args) -> int:
    from marft_jax.train.trainer import train

    cfg = _load(args.config, "demo")
    summary = train(cfg, resume=not args.no_resume)
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    fmt = lambda x: "not evaluated" if x is None else f"{x:.3f}"
    print()
    if after is not None:
        what = "mean accuracy of the independent agents" if summary.get("independent") else "team accuracy"
        print(f"{what} on held-out problems: {fmt(before)} -> {fmt(after)}")
    else:
        print(f"stopped after {summary['iterations']} iterations (accuracy before: {fmt(before)}); "
              f"run the same command again to resume")
    print(f"run directory: {summary['run_dir']}")
    print(f"checkpoint:    {summary['checkpoint']}")
    print(f"metrics:       {summary['metrics']}")
    if summary.get("plots"):
        print(f"plots:         {Path(summary['plots'][0]).parent}")
    return 0


def cmd_eval(args) -> int:
    import itertools

    from marft_jax.train.build import build_run, fresh_state
    from marft_jax.train.checkpoint import CheckpointManager
    from marft_jax.train.evaluate import evaluate
    from marft_jax.train.trainer import method_fields

    cfg = _load(args.config, "demo")
    run = build_run(cfg)
    try:
        state = fresh_state(cfg, run.model.cfg, seed=0)
        source = "base model (fresh adapters = identity)"
        if args.run:
            ckpt = CheckpointManager(Path(args.run) / "checkpoints", async_save=False, read_only=True)
            state, extra = ckpt.restore(args.step, target_state=state)
            source = f"{ckpt.step_path(int(extra['iteration']))}"
            ckpt.close()
        state = run.learner.place_state(state)
        problems = list(itertools.islice(run.task.problems("test", 0), args.problems))
        res = evaluate(run.learner, state, problems, temperature=args.temperature,
                       seeds=list(range(args.seeds)), batch_size=max(cfg.rollout.rows, 8))
        out = Path(args.out or (Path(args.run) / "eval" if args.run else "eval"))
        out.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": run.task.name, "source": source, "problems": len(problems),
               "temperature": args.temperature, **method_fields(cfg), "seeds": res.team, **res.summary()}
        stem = f"{run.task.name}-T{args.temperature}"
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=2))
        rows = [("team", res.team)] + list(res.per_agent.items())
        md = ["| who | accuracy (mean ± std over %d seeds) |" % args.seeds, "|---|---|"]
        md += [f"| {k} | {100 * _mean(v):.1f} ± {100 * _std(v):.1f} |" for k, v in rows]
        (out / f"{stem}.md").write_text("\n".join(md) + "\n")
        (out / f"{stem}.csv").write_text("who,mean,std," + ",".join(f"seed{i}" for i in range(args.seeds)) + "\n" +
                                         "\n".join(f"{k},{_mean(v):.4f},{_std(v):.4f}," + ",".join(f"{x:.4f}" for x in v)
                                                   for k, v in rows) + "\n")
        print("\n".join(md))
        print(f"written: {out / stem}.{{json,md,csv}}")
    finally:
        run.close()
    return 0


def _mean(v):
    import numpy as np

    return float(np.mean(v))


def _std(v):
    import numpy as np

    return float(np.std(v))


def cmd_generate(args) -> int:
    import jax

    from marft_jax.envs.chat import HFChatTokenizer
    from marft_jax.models import quant_matmul
    from marft_jax.models.registry import load_model
    from marft_jax.sampling.sampler import Sampler, SamplingConfig

    model = load_model(args.model, revision=args.revision)
    tok = HFChatTokenizer(model.tokenizer, stop_ids=model.stop_token_ids)
    prompts = args.prompt or ["What is 12 + 30? Answer with a number.",
                              "Name three primary colours.",
                              "Tom has 3 apples and buys 4 more. How many apples does he have?"]
    ids = [tok.encode_chat([{"role": "user", "content": p}]) if not args.raw else tok.encode_text(p)
           for p in prompts]
    # a quantized GGUF checkpoint's decode steps read its blocks where the native kernel runs
    weights = quant_matmul.resolve("auto", quantized=model.quantized is not None,
                                   dtype=jax.tree.leaves(model.params)[0].dtype)
    model_cfg = dataclasses.replace(model.cfg, decode_weights=weights)
    sampler = Sampler(model_cfg, pad_id=tok.pad_id, stop_ids=tok.stop_ids,
                      quantized=model.quantized if weights == "native" else None)
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p)
    import time

    t0 = time.perf_counter()
    out = sampler(model.params, ids, key=jax.random.key(args.seed), config=cfg)
    dt = time.perf_counter() - t0
    for p, toks, n in zip(prompts, out.tokens, out.lengths):
        print(f">>> {p}\n{tok.decode(toks[:n]).strip()}\n")
    print(f"[{model.source}] {int(out.lengths.sum())} tokens in {dt:.1f}s (compile included)")
    return 0


def cmd_bench(args) -> int:
    import importlib

    from marft_jax import profiling

    rest = list(args.rest)
    profile_dir = None
    if "--profile" in rest:              # `bench NAME --profile DIR`: a jax.profiler trace of the run
        i = rest.index("--profile")
        if i + 1 >= len(rest):
            print("bench: --profile needs a directory", file=sys.stderr)
            return 2
        profile_dir = rest[i + 1]
        del rest[i:i + 2]
        os.environ[profiling.ENV_DIR] = profile_dir   # sides that run in subprocesses trace themselves
    mod = importlib.import_module(f"marft_jax.bench.{args.which}")
    with profiling.trace(None if args.which == "iteration" else profile_dir):
        res = mod.main(rest)             # the benchmarks return their report (a dict) or an exit status
    return res if isinstance(res, int) else 0


def cmd_table(args) -> int:
    from marft_jax.train.run_records import expand_run_dirs
    from marft_jax.train.table import write_table

    # No --format: Markdown printed, Markdown and CSV written (as before the switch existed).
    formats = [args.format] if args.format else ["markdown", "csv"]
    paths = write_table(expand_run_dirs(args.run_dirs), args.out, formats=formats, tags=args.tag)
    print(Path(paths[0]).read_text(encoding="utf-8"))
    print("written: " + ", ".join(map(str, paths)))
    return 0


def cmd_plot(args) -> int:
    from marft_jax.train.run_records import is_run_dir

    single = len(args.paths) == 1 and is_run_dir(Path(args.paths[0])) and args.out is None
    if single:                # one run folder: its own training curves, as before
        from marft_jax.train.plot import plot_run

        for p in plot_run(args.paths[0]):
            print(p)
        return 0
    from marft_jax.train.sweep_plot import HELDOUT_FILE, plot_heldout

    print(plot_heldout(args.paths, args.out or HELDOUT_FILE))
    return 0


def cmd_preflight(args) -> int:
    from marft_jax.preflight import main as preflight

    return preflight(args, lambda items: _load(items, "demo"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="marft-jax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a team (default: the embedded `demo` preset)", epilog=EPILOG,
                       description="Train with a preset or YAML file plus key=value overrides. With no "
                                   "arguments: the demo (SmolLM2-135M, planner -> solver, arithmetic, MARFT-A, CPU).")
    t.add_argument("config", nargs="*", help="[PRESET|FILE.yaml] [key=value ...]")
    t.add_argument("--no-resume", action="store_true", help="ignore checkpoints in the run directory")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint or the base model", epilog=EPILOG,
                       description="Team and per-agent accuracy on the task's held-out split, N seeds, "
                                   "written as JSON, Markdown and CSV (mean ± population std).")
    e.add_argument("config", nargs="*", help="[PRESET|FILE.yaml] [key=value ...] (same as training)")
    e.add_argument("--run", help="run directory whose checkpoint to load (default: the base model)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest valid)")
    e.add_argument("--seeds", type=int, default=5, help="sampling seeds (default 5)")
    e.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)")
    e.add_argument("--problems", type=int, default=500, help="held-out problems (default 500)")
    e.add_argument("--out", help="output directory (default: RUN/eval or ./eval)")
    e.set_defaults(fn=cmd_eval)

    g = sub.add_parser("generate", help="sample from a model (chat template applied)")
    g.add_argument("--model", default="smollm2-135m", help="registry name, HF directory, .gguf file or Hub id org/name")
    g.add_argument("--revision", default=None, help="Hub branch, tag or commit of an org/name model (default main)")
    g.add_argument("--prompt", action="append", help="a user message (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks printing JSON (sampler, backups, update, iteration, scaling, "
                                     "estimators, attention)",
                       description="Run a benchmark; arguments after the name go to it (try `bench sampler --help`). "
                                   "`iteration`: one whole training iteration, ours vs the reference pipeline. "
                                   "`scaling --devices D`: per-device compiled FLOPs on D simulated CPU devices. "
                                   "`estimators`: seconds per iteration, algo.advantage=group vs gae. "
                                   "`attention`: whole-row attention, model.causal_attention native vs xla. "
                                   "`--profile DIR` (after the name) writes a jax.profiler trace of the run "
                                   "(of our measured iteration for `iteration`).")
    b.add_argument("which", choices=["sampler", "backups", "update", "iteration", "scaling", "estimators",
                                     "attention"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    tb = sub.add_parser("table", help="aggregate eval results of runs into the paper's table layout",
                        description="Methods as rows (grouped by team: Single, Duo, Trio; named and anonymous "
                                    "roles apart), benchmarks as columns, cells: accuracy in %%, mean ± standard "
                                    "error over the seeds (the runs) of each method.")
    tb.add_argument("run_dirs", nargs="+", help="run folders, or sweep folders holding run folders")
    tb.add_argument("--out", default="results", help="output directory (default: results)")
    tb.add_argument("--format", choices=["markdown", "csv", "latex"], default=None,
                    help="print and write results.md, results.csv or results.tex (default: print Markdown, "
                         "write Markdown and CSV)")
    tb.add_argument("--tag", action="append", default=None,
                    help="only eval files with this tag (before, after); repeatable (default: every file)")
    tb.set_defaults(fn=cmd_table)

    pl = sub.add_parser("plot", help="PNG training curves of a run, or held-out accuracy of many runs",
                        description="One run folder: its training curves into RUN/plots/. Several run folders "
                                    "or a sweep folder (or --out): one figure of every method's mean held-out "
                                    "accuracy per iteration with a band of ±1 standard error over seeds.")
    pl.add_argument("paths", nargs="+", metavar="RUN_DIR", help="run folders or sweep folders")
    pl.add_argument("--out", default=None,
                    help="the held-out accuracy figure (default: ./heldout_accuracy.png)")
    pl.set_defaults(fn=cmd_plot)

    pf = sub.add_parser("preflight", help="lower every program of a run for a GPU or TPU, on this CPU, offline",
                        epilog=EPILOG,
                        description="Check a config before paying for the pod: the run's prefill, decode, "
                                    "feature, recompute, update and evaluation programs at the shapes the run "
                                    "produces, lowered for --platform on a mesh of --devices simulated devices, "
                                    "with abstract weights (the model's config.json only). One line per program; "
                                    "exit status 1 at the first that fails, naming the config key to change.")
    from marft_jax.preflight import add_arguments

    add_arguments(pf)
    pf.set_defaults(fn=cmd_preflight)
    return p


def main(argv: list[str] | None = None) -> int:
    from marft_jax.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
