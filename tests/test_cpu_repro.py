"""experiments/cpu_repro.py end to end on a tiny random model (runs, table, CSV, reuse), and its
results writer on synthetic run folders (--aggregate-only: statistics, table, figures)."""

from __future__ import annotations

import csv
import json
import importlib.util
from pathlib import Path

import pytest

from tests.synthetic_runs import make_run
from tests.tiny_run import tiny_overrides

REPO = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("cpu_repro", REPO / "experiments" / "cpu_repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_repro_writes_table_and_reuses_finished_runs(tmp_path, tiny_model_dir):
    cpu_repro = _load()
    over = tiny_overrides(tiny_model_dir, tmp_path, "ignored", **{"train.iterations": 2})
    argv = ["--seeds", "0", "--methods", "marft_a", "marft_t", "--runs-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out"), "--no-compile-cache", *over]
    rows = cpu_repro.main(argv)
    assert [r["method"] for r in rows] == ["marft_a", "marft_t"]
    assert all(r["iterations"] == 2 and len(r["train_reward"]) == 2 for r in rows)
    # MARFT-T shares MARFT-A's untrained evaluation (same prompts, same base model)
    runs = tmp_path / "runs"
    assert (runs / "marft_a-s0" / "eval" / "before.json").exists()
    assert not (runs / "marft_t-s0" / "eval" / "before.json").exists()
    shared = json.loads((runs / "marft_t-s0" / "summary.json").read_text())
    assert shared["accuracy_before_from"] == "marft_a-s0"
    assert rows[1]["accuracy_before"] == rows[0]["accuracy_before"]
    table = (tmp_path / "out" / "results.md").read_text()
    assert "MARFT-A (Duo, chained, action level)" in table and "MARFT-T" in table
    assert "python experiments/cpu_repro.py --seeds 0" in table
    with open(tmp_path / "out" / "results.csv") as f:
        assert [r["method"] for r in csv.DictReader(f)] == ["marft_a", "marft_t"]
    assert (tmp_path / "out" / "training_reward.png").stat().st_size > 0
    assert (tmp_path / "out" / "heldout_accuracy.png").stat().st_size > 0     # the runs' held-out curves
    assert "\\midrule" in (tmp_path / "out" / "table.tex").read_text()
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [sorted(r["heldout"]) for r in saved["runs"]] == [["0", "2"], ["0", "2"]]
    assert "## Reading\n\n" + cpu_repro.READING_PLACEHOLDER in table

    stamp = (tmp_path / "runs" / "marft_a-s0" / "metrics.jsonl").stat().st_mtime_ns
    again = cpu_repro.main(argv)                      # finished runs are reused, not retrained
    assert (tmp_path / "runs" / "marft_a-s0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert [r["accuracy_after"] for r in again] == [r["accuracy_after"] for r in rows]

    # A sweep over another seed shares the untrained evaluation the first sweep made
    other = ["--seeds", "1", "--methods", "marft_t", *argv[5:]]
    (row,) = cpu_repro.main(other)
    assert not (runs / "marft_t-s1" / "eval" / "before.json").exists()
    assert json.loads((runs / "marft_t-s1" / "summary.json").read_text())["accuracy_before_from"] == "marft_a-s0"
    assert row["accuracy_before"] == rows[0]["accuracy_before"]


def test_a_longer_sweep_extends_finished_runs(tmp_path, tiny_model_dir):
    """A sweep run again with more iterations resumes each finished run from its last
    checkpoint; its old trained evaluation becomes a point of the held-out curve; the result is
    the run that a fresh sweep with the longer budget trains."""
    cpu_repro = _load()
    runs = tmp_path / "runs"
    argv = lambda n, runs_dir: ["--seeds", "0", "--methods", "marft_a", "--runs-dir", str(runs_dir),
                                "--out", str(tmp_path / "out"), "--no-compile-cache",
                                *tiny_overrides(tiny_model_dir, tmp_path, "ignored", **{"train.iterations": n,
                                                                                        "train.eval_every": 2})]
    short = cpu_repro.main(argv(2, runs))
    longer = cpu_repro.main(argv(4, runs))
    fresh = cpu_repro.main(argv(4, tmp_path / "fresh"))
    run = runs / "marft_a-s0"
    assert (run / "eval" / "periodic" / "iter000002.json").is_file() and (run / "eval" / "after.json").is_file()
    assert longer[0]["iterations"] == 4 and sorted(longer[0]["heldout"]) == [0, 2, 4]
    assert longer[0]["heldout"][2] == short[0]["accuracy_after"]
    assert longer[0]["wall_s"] > short[0]["wall_s"]                        # the time of both parts
    for key in ("accuracy_before", "accuracy_after", "train_reward", "heldout"):
        assert longer[0][key] == fresh[0][key], key


def test_untrained_evaluation_is_shared_where_identical():
    cpu_repro = _load()
    from marft_jax.config import load_config

    keys = {m: cpu_repro.untrained_key(load_config(f"cpu_repro/{m}", [f"train.seed={s}"]))
            for m in cpu_repro.METHODS for s in (0, 1)}
    assert keys["marft_a"] == keys["marft_t"]
    assert len({keys["marft_a"], keys["ippo"], keys["single"]}) == 3


def test_method_arms_match_the_trainers_eval_files():
    """The results table groups each method as the trainer's eval files do."""
    cpu_repro = _load()
    from marft_jax.config import load_config
    from marft_jax.train.trainer import method_fields

    for m in cpu_repro.METHODS:
        f = method_fields(load_config(f"cpu_repro/{m}", []))
        assert (f["method"], f["agents"], f["roles"]) == cpu_repro.METHOD_ARMS[m], m
        assert f["independent"] == (m in ("ippo", "trio_ippo")), m          # reported as the mean over agents
    assert set(cpu_repro.METHOD_ARMS) == set(cpu_repro.METHODS)


def test_untrained_rows_are_named_by_their_prompts():
    """The eval/before.json method: one name per untrained team (MARFT-A and MARFT-T share it,
    the parallel IPPO team and the single agent do not), as the sweep shares the evaluations."""
    cpu_repro = _load()
    from marft_jax.config import load_config
    from marft_jax.train.trainer import untrained_method

    names = {m: untrained_method(load_config(f"cpu_repro/{m}", [])) for m in cpu_repro.METHODS}
    assert names["marft_a"] == names["marft_t"] == names["trio_marft_a"] == "untrained base (chained team prompts)"
    assert names["ippo"] == names["trio_ippo"] == "untrained base (parallel team prompts)"
    assert names["single"] == "untrained base (single-agent prompt)"


# change after training per method (points over the untrained 14 %), one value per seed
GAINS = {"marft_a": [20, 22, 21, 19, 23], "marft_t": [-5, 30, 0, 25, -8], "ippo": [4, 5, 3, 6, 5],
         "single": [0, 1, -1, 2, 0], "marft_a_anonymous": [19, 23, 20, 22, 21],
         "trio_marft_a": [30, 31, 29, 32, 30], "trio_ippo": [5, 4, 6, 5, 5]}


def _sweep(root, seeds=range(5)):
    for m, gains in GAINS.items():
        method, agents, roles = _load().METHOD_ARMS[m]
        for s in seeds:
            after = 0.14 + gains[s] / 100
            make_run(root, f"{m}-s{s}", method=method, agents=agents, roles=roles, seed=s, before=0.14,
                     periodic={10: 0.14 + gains[s] / 200, 20: after - 0.01}, after=after, share_before=s > 0)


def test_aggregate_only_writes_results_of_finished_runs(tmp_path):
    cpu_repro = _load()
    runs, out = tmp_path / "runs", tmp_path / "out"
    _sweep(runs)
    make_run(runs, "marft_a-s5", method="MARFT-A", agents=2, seed=5, periodic={10: 0.9}, after=None)  # running
    make_run(runs, "mystery-s0", method="X", agents=2)                         # not a method of the sweep
    (runs / ".jax_cache").mkdir()
    rows = cpu_repro.main(["--aggregate-only", "--runs-dir", str(runs), "--out", str(out), "--seeds", *map(str, range(6))])
    assert len(rows) == 35 and [(r["method"], r["seed"]) for r in rows[:2]] == [("marft_a", 0), ("marft_t", 0)]
    assert {f.name for f in out.iterdir()} == {"results.md", "results.csv", "results.json", "table.tex",
                                               "heldout_accuracy.png", "training_reward.png"}
    md = (out / "results.md").read_text()
    assert "--aggregate-only" in md and "Aggregated without training" in md
    assert "| Duo | independent PPO | named | 18.6 ± 0.5 |" in md                     # paper layout, mean ± SE
    assert "|  | MARFT-A | anonymous | 35.0 ± 0.7 |" in md
    assert "| Trio | independent PPO | named | 19.0 ± 0.3 |" in md
    line = next(l for l in md.splitlines() if l.startswith("| MARFT-A (Duo, chained, action level) | Duo | 5 |"))
    assert "+21.0 ± 0.7" in line and line.endswith("| above IPPO |")
    line = next(l for l in md.splitlines() if l.startswith("| MARFT-T (Duo, chained, token level) |"))
    assert line.endswith("| not separated |")                                   # wide spread: the interval holds 0
    line = next(l for l in md.splitlines() if l.startswith("| single agent (PPO-A) |"))
    assert line.endswith("| below IPPO |")
    assert "| MARFT-A · Duo steadier |" in md and "| margin wider |" in md
    assert "MARFT-A · Duo − change of MARFT-A · Duo · anonymous | +0.0 |" in md
    assert md.rstrip().endswith("## Reading\n\n" + cpu_repro.READING_PLACEHOLDER)

    saved = json.loads((out / "results.json").read_text())                     # strict JSON: no NaN
    assert saved["statistics"]["vs_baseline"]["trio_marft_a"]["baseline"] == "trio_ippo"
    assert saved["statistics"]["methods"]["single"]["worst_change_pp"] == pytest.approx(-1.0)
    assert saved["runs"][0]["heldout"] == {"0": 0.14, "10": pytest.approx(0.24), "20": pytest.approx(0.33),
                                           "30": pytest.approx(0.34)}
    tex = (out / "table.tex").read_text()
    assert tex.count("\\midrule") == 3 and "Single & single agent (PPO-A)" in tex
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 35

    # a hand-written reading survives the next aggregation; a partial sweep still aggregates
    (out / "results.md").write_text(md.replace(cpu_repro.READING_PLACEHOLDER, "Only MARFT-A separates."))
    rows = cpu_repro.main(["--aggregate-only", "--runs-dir", str(runs), "--out", str(out), "--methods", "marft_a", "ippo",
                           "--seeds", "0"])
    md = (out / "results.md").read_text()
    assert len(rows) == 2 and md.rstrip().endswith("## Reading\n\nOnly MARFT-A separates.")
    assert "| +16.0 | – | too few seeds |" in md                                     # one seed: no interval


def test_aggregate_only_errors(tmp_path):
    cpu_repro = _load()
    with pytest.raises(FileNotFoundError, match="--runs-dir.*nowhere"):
        cpu_repro.main(["--aggregate-only", "--runs-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    make_run(tmp_path / "runs", "marft_a-s0", method="MARFT-A", agents=2, after=None)
    with pytest.raises(SystemExit, match="no finished run in .*runs"):
        cpu_repro.main(["--aggregate-only", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_prior_results_carry_runs_trained_elsewhere(tmp_path):
    """--prior-results: the runs of a committed results.json (their run folders gone) pool with the
    run folders of new seeds into one set of results, as if all were in one folder; a run in both
    is read from its folder; each row says where it came from; carrying a file over itself keeps it."""
    cpu_repro = _load()
    first, later = tmp_path / "first", tmp_path / "later"
    _sweep(first, seeds=[0, 1])
    _sweep(later, seeds=[2, 3])
    cpu_repro.main(["--aggregate-only", "--runs-dir", str(first), "--out", str(tmp_path / "o1")])
    prior = tmp_path / "o1" / "results.json"

    rows = cpu_repro.main(["--aggregate-only", "--runs-dir", str(later), "--out", str(tmp_path / "o2"),
                           "--seeds", "0", "1", "2", "3", "--prior-results", str(prior)])
    ref = cpu_repro.collect_rows(first, seeds=[0, 1]) + cpu_repro.collect_rows(later, seeds=[2, 3])
    key = lambda r: (r["seed"], list(cpu_repro.METHODS).index(r["method"]))
    assert [(r["method"], r["seed"]) for r in rows] == [(r["method"], r["seed"]) for r in sorted(ref, key=key)]
    assert len(rows) == 28
    for r, e in zip(rows, sorted(ref, key=key)):
        for k in ("accuracy_before", "accuracy_after", "delta", "iterations", "train_reward", "heldout", "benchmark"):
            assert r[k] == pytest.approx(e[k]), (r["method"], r["seed"], k)
    assert {r["source"] for r in rows if r["seed"] >= 2} == {"run folder"}
    assert {r["source"] for r in rows if r["seed"] < 2} == {f"results.json of {cpu_repro._commit()} ({json.loads(prior.read_text())['date']})"}
    md = (tmp_path / "o2" / "results.md").read_text()
    assert "28 runs (14 from run folders, 14 carried over from results.json of" in md
    line = next(l for l in md.splitlines() if l.startswith("| MARFT-A (Duo, chained, action level) | Duo | 4 |"))
    assert line.endswith("| above IPPO |")                                       # four seeds: an interval
    assert "| marft_a | 2 | 14.0 | 35.0 | +21.0 | – | 30 | 100.0 | run folder |" in md

    # the written file carries over itself, sources kept; a run in both is read from its folder
    out2 = tmp_path / "o2" / "results.json"
    (later / "marft_a-s2").rename(tmp_path / "gone")
    make_run(later, "marft_a-s1", method="MARFT-A", agents=2, seed=1, before=0.14, after=0.99)
    again = cpu_repro.main(["--aggregate-only", "--runs-dir", str(later), "--out", str(tmp_path / "o2"),
                            "--seeds", "0", "1", "2", "3", "--prior-results", str(out2)])
    by = {(r["method"], r["seed"]): r for r in again}
    assert len(again) == 28 and by["marft_a", 1]["accuracy_after"] == 0.99 and by["marft_a", 1]["source"] == "run folder"
    assert by["marft_a", 2]["source"] == by["marft_a", 0]["source"] != "run folder"   # carried twice, still named
    assert by["marft_a", 2]["accuracy_after"] == pytest.approx(0.35)
    # no run folder at all: the carried runs alone
    alone = cpu_repro.main(["--aggregate-only", "--runs-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o3"),
                            "--prior-results", str(out2), "--methods", "single"])
    assert [r["seed"] for r in alone] == [0, 1, 2, 3]


def test_prior_results_errors_name_the_file_and_field(tmp_path):
    cpu_repro = _load()
    args = lambda f: ["--aggregate-only", "--runs-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--prior-results", str(f)]
    with pytest.raises(FileNotFoundError, match="--prior-results .*missing.json.* does not exist"):
        cpu_repro.main(args(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--prior-results .*bad.json.*not JSON"):
        cpu_repro.main(args(bad))
    bad.write_text(json.dumps({"table": []}))
    with pytest.raises(ValueError, match="bad.json.*no 'runs' list"):
        cpu_repro.main(args(bad))
    run = {"method": "marft_a", "seed": 0, "accuracy_before": 0.1, "accuracy_after": 0.2, "iterations": 30,
           "train_reward": [0.1]}
    bad.write_text(json.dumps({"runs": [run, {**run, "accuracy_after": None}]}))
    with pytest.raises(ValueError, match=r"bad.json.*runs\[1\]: missing field\(s\) \['accuracy_after'\]"):
        cpu_repro.main(args(bad))
    bad.write_text(json.dumps({"runs": [{**run, "method": "ppo"}]}))
    with pytest.raises(ValueError, match=r"runs\[0\]: field 'method' is 'ppo'"):
        cpu_repro.main(args(bad))
    bad.write_text(json.dumps({"runs": [{**run, "seed": "zero"}]}))
    with pytest.raises(ValueError, match=r"runs\[0\]: a field is not a number"):
        cpu_repro.main(args(bad))
    assert not (tmp_path / "o").exists()


def test_independent_ppo_reports_the_mean_of_its_agents(tmp_path):
    """Reference §10: independent PPO's accuracy is the mean of its agents' accuracies; the
    all-correct verdict goes beside it. The eval files predate the ``independent`` key and the
    untrained label that names parallel prompts (as the sweep's first runs wrote them): the run's
    config.yaml says the agents are independent. A later seed reads the untrained evaluation of
    the run it shares it with."""
    from marft_jax.train.table import aggregate, render

    cpu_repro = _load()
    runs, out = tmp_path / "runs", tmp_path / "out"
    for s, (planner, solver, all_correct) in enumerate([(0.60, 0.66, 0.47), (0.50, 0.70, 0.40)]):
        make_run(runs, f"ippo-s{s}", method="independent PPO", agents=2, seed=s, before=0.12, after=all_correct,
                 before_method="untrained base (team prompts)", share_before=s > 0, before_from="ippo-s0", mode="parallel",
                 per_agent_before={"planner": 0.24, "solver": 0.30},
                 per_agent_after={"planner": planner, "solver": solver})
    make_run(runs, "marft_a-s0", method="MARFT-A", agents=2, before=0.14, after=0.39,
             per_agent_after={"planner": 0.16, "solver": 0.39})
    rows = cpu_repro.main(["--aggregate-only", "--runs-dir", str(runs), "--out", str(out), "--seeds", "0", "1"])
    ippo = [r for r in rows if r["method"] == "ippo"]
    assert [r["accuracy_before"] for r in ippo] == pytest.approx([0.27, 0.27])    # shared: ippo-s0's before.json
    assert [r["accuracy_after"] for r in ippo] == pytest.approx([0.63, 0.60])
    assert [r["all_correct_after"] for r in ippo] == pytest.approx([0.47, 0.40])
    assert [r["all_correct_before"] for r in ippo] == pytest.approx([0.12, 0.12])
    marft = next(r for r in rows if r["method"] == "marft_a")                     # the answering agent, not a mean
    assert marft["accuracy_after"] == pytest.approx(0.39) and marft["all_correct_after"] is None

    md = (out / "results.md").read_text()
    assert "| Duo | independent PPO | named | 61.5 ± 1.5 (n=2) |" in md
    assert "|  | independent PPO (all agents correct) | named | 43.5 ± 3.5 (n=2) |" in md
    assert "## Independent PPO: every agent correct" in md
    assert "| ippo | 0 | 27.0 | 63.0 | +36.0 | 12.0 → 47.0 |" in md

    table = aggregate([runs / "ippo-s0", runs / "ippo-s1"], tags=["after"])        # marft-jax table: the same cells
    assert [r["method"] for r in table] == ["independent PPO", "independent PPO (all agents correct)"]
    assert table[0]["cells"]["arithmetic"]["seeds"] == pytest.approx([0.63, 0.60])
    assert table[1]["cells"]["arithmetic"]["seeds"] == pytest.approx([0.47, 0.40])
    assert "every agent's answer accepted" in render(table, "markdown")
    untrained = [r for r in aggregate([runs / "ippo-s0", runs / "marft_a-s0"], tags=["before"])]
    assert [(r["method"], r["cells"]["arithmetic"]["mean"]) for r in untrained] == [    # the old label, split
        ("untrained base (parallel team prompts)", pytest.approx(0.27)),
        ("untrained base (parallel team prompts) (all agents correct)", pytest.approx(0.12)),
        ("untrained base (team prompts)", pytest.approx(0.14))]                    # no mode in its config
