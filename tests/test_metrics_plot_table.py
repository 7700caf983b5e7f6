"""Metrics writer (JSONL + TensorBoard, resume truncation), MFU, per-agent names, timers,
training-curve plots and the results table."""

from __future__ import annotations

import csv
import io
import json
import math
import time

import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.train import metrics as M
from marft_jax.train.plot import plot_run
from marft_jax.train.table import ResultsSchemaError, aggregate, render, to_csv, to_markdown, write_table


def _lines(run_dir):
    return [json.loads(l) for l in (run_dir / M.METRICS_FILE).read_text().splitlines()]


def _tb_scalars(run_dir):
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted((run_dir / M.TB_DIR).glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):  # TFRecord: len u64, crc u32, payload, crc u32
            n = int.from_bytes(data[pos:pos + 8], "little")
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            out += [(ev.step, v.tag, v.simple_value) for v in ev.summary.value]
            if ev.HasField("session_log"):
                out.append((ev.step, "session_log", ev.session_log.status))
    return out


def test_writer_jsonl_tensorboard_and_resume_truncation(tmp_path):
    roles = M.role_names(2, ["planner", "solver"])
    with M.MetricsWriter(tmp_path) as w:
        for step in range(1, 6):
            rec = {"episode/accuracy": jnp.float32(step / 10), "perf/throughput": np.float64(100.0 * step),
                   "critic/value_loss": float("nan") if step == 3 else 1.0 / step}
            rec.update(M.per_agent("actor", {"pg_loss": jnp.array([step, -step], jnp.float32)}, roles))
            w.write(step, rec)
            # flushed line by line: readable while the writer is open
            assert _lines(tmp_path)[-1]["step"] == step
    rows = _lines(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[1]["actor/planner/pg_loss"] == 2.0 and rows[1]["actor/solver/pg_loss"] == -2.0
    assert rows[2]["critic/value_loss"] == "nan" and math.isnan(float(rows[2]["critic/value_loss"]))
    assert rows[0]["episode/accuracy"] == pytest.approx(0.1)
    tb = _tb_scalars(tmp_path)
    assert (4, "perf/throughput", 400.0) in tb and (2, "actor/solver/pg_loss", -2.0) in tb

    # Crash after step 5 with a torn line; resume from the step-3 checkpoint.
    with open(tmp_path / M.METRICS_FILE, "a") as f:
        f.write('{"step": 6, "episode/acc')
    with M.MetricsWriter(tmp_path, ["jsonl", "tensorboard"], resume_step=3) as w:
        assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3]
        w.write(4, {"episode/accuracy": 0.9})
    rows = _lines(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["episode/accuracy"] == 0.9
    assert M.read_metrics(tmp_path)[-1]["step"] == 4
    # TensorBoard is told to purge the abandoned steps >= 4 (SessionLog.START at purge_step).
    from tensorboardX.proto.event_pb2 import SessionLog
    assert (4, "session_log", SessionLog.START) in _tb_scalars(tmp_path)


def test_writer_without_tensorboard_and_reserved_names(tmp_path):
    w = M.MetricsWriter(tmp_path, ["jsonl"])
    w.write(1, {"x": np.array([1.0, 2.0]), "tag": "ok"})
    with pytest.raises(ValueError, match="reserved"):
        w.write(2, {"step": 3})
    w.close()
    assert not (tmp_path / M.TB_DIR).exists()
    assert _lines(tmp_path)[0]["x"] == [1.0, 2.0]


def test_mfu_and_names():
    # 1e15 FLOPs in 2 s on 4 devices of 1e15 peak -> 12.5 %.
    assert M.mfu(1e15, 2.0, 4, 1e15) == pytest.approx(0.125)
    assert M.mfu(1e15, 0.0, 4, 1e15) == 0.0
    assert M.device_peak_flops(type("D", (), {"device_kind": "NVIDIA H200"})()) == 989e12
    assert M.device_peak_flops(type("D", (), {"device_kind": "cpu"})()) is None
    assert M.role_names(3) == ["agent0", "agent1", "agent2"]
    for bad in (["a"], ["a", "a"], ["a/b", "c"]):
        with pytest.raises(ValueError):
            M.role_names(2, bad)
    out = M.per_agent("completions", {"mean_length": np.array([10, 20]), "clipped_ratio": np.array([0.0, 0.5])},
                      ["agent0", "agent1"])
    assert out == {"completions/agent0/mean_length": 10.0, "completions/agent1/mean_length": 20.0,
                   "completions/agent0/clipped_ratio": 0.0, "completions/agent1/clipped_ratio": 0.5}
    with pytest.raises(ValueError, match=r"want \[2\]"):
        M.per_agent("actor", {"pg_loss": np.zeros(3)}, ["a", "b"])


def test_timer_blocks_and_accumulates():
    class Slow:
        """Stands in for an async result: ready only after block_until_ready."""
        blocked = False

        def block_until_ready(self):
            time.sleep(0.05)
            Slow.blocked = True
            return self

    times = {}
    with M.Timer("rollout", times) as t:
        v = t.ready(Slow())
    assert Slow.blocked and isinstance(v, Slow) and times["timing_s/rollout"] >= 0.05
    with M.Timer("rollout", times, block_on=jnp.ones(3)):
        pass
    assert times["timing_s/rollout"] >= t.seconds and list(times) == ["timing_s/rollout"]


def test_plot_run_writes_pngs(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / M.METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match="no numeric metrics"):
        plot_run(tmp_path)
    with M.MetricsWriter(tmp_path, ["jsonl"]) as w:
        for s in range(1, 5):
            w.write(s, {"rewards/agent0/mean": 0.1 * s, "rewards/agent1/mean": 0.2 * s, "episode/accuracy": 0.25 * s,
                        "actor/agent0/pg_loss": -0.1, "critic/value_loss": 1.0 / s,
                        "actor/agent0/approx_kl": 0.01, "perf/throughput": 1e3, "timing_s/step": 2.0})
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == sorted(
        ["reward.png", "accuracy.png", "losses.png", "kl.png", "throughput.png", "timing.png"])
    for p in paths:
        assert p.parent == tmp_path / "plots" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _result(run_dir, name, **rec):
    (run_dir / "eval").mkdir(parents=True, exist_ok=True)
    (run_dir / "eval" / f"{name}.json").write_text(json.dumps(rec))


def test_table_aggregate_markdown_csv(tmp_path):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    _result(a, "l1", method="MARFT-A", agents=2, roles="named", benchmark="arithmetic-l1",
            seeds=[0.5, 0.7], seed_ids=[0, 1], per_agent={"planner": [0.4, 0.6], "solver": [0.5, 0.7]})
    _result(b, "l1", method="MARFT-A", agents=2, roles="named", benchmark="arithmetic-l1",
            seeds=[0.6], seed_ids=[2])
    _result(a, "gsm", method="MARFT-A", agents=2, roles="named", benchmark="gsm8k", seeds=[0.3])
    _result(b, "anon", method="MARFT-A", agents=2, roles="anonymous", benchmark="arithmetic-l1", seeds=[0.4, 0.5])
    _result(b, "base", method="base", agents=1, roles="named", benchmark="gsm8k", seeds=[0.1, 0.2, 0.3])
    rows = aggregate([a, b])
    assert [(r["method"], r["agents"], r["roles"]) for r in rows] == [
        ("MARFT-A", 2, "named"), ("MARFT-A", 2, "anonymous"), ("base", 1, "named")]
    cell = rows[0]["cells"]["arithmetic-l1"]
    assert cell["n"] == 3 and cell["mean"] == pytest.approx(0.6)
    assert cell["std"] == pytest.approx(math.sqrt(((0.1) ** 2 + 0 + (0.1) ** 2) / 3))  # population std
    assert rows[0]["per_agent"]["arithmetic-l1"] == {"planner": pytest.approx(0.5), "solver": pytest.approx(0.6)}

    assert cell["se"] == pytest.approx(0.1 / math.sqrt(3))                          # sample std / sqrt(n)
    assert rows[0]["per_agent"]["arithmetic-l1"] == {"planner": pytest.approx(0.5), "solver": pytest.approx(0.6)}

    # The paper's layout: grouped by team (Single before Duo), mean ± SE; seed counts differ
    # between cells, so every cell names its n.
    md = to_markdown(rows)
    lines = md.splitlines()
    assert lines[0] == "| team | method | roles | arithmetic-l1 | gsm8k |"
    assert lines[2] == "| Single | base | named | – | 20.0 ± 5.8 (n=3) |"
    assert lines[3] == "| Duo | MARFT-A | named | 60.0 ± 5.8 (n=3) | 30.0 (n=1) |"   # one seed: no SE
    assert lines[4] == "|  | MARFT-A | anonymous | 45.0 ± 5.0 (n=2) | – |"
    assert "mean ± standard error over seeds" in lines[6] and "seeds per cell in brackets" in lines[6]
    assert to_markdown(rows, spread="std").splitlines()[3] == \
        "| Duo | MARFT-A | named | 60.0 ± 8.2 (n=3) | 30.0 ± 0.0 (n=1) |"          # population std, as before
    table = list(csv.reader(io.StringIO(to_csv(rows))))
    assert table[0] == ["team", "method", "roles", "arithmetic-l1 (% mean ± SE)", "gsm8k (% mean ± SE)"]
    assert table[2] == ["Duo", "MARFT-A", "named", "60.0 ± 5.8 (n=3)", "30.0 (n=1)"]
    assert table[3][0] == "Duo"                                                    # the team on every row
    md_path, csv_path = write_table([a, b], tmp_path / "out")
    assert md_path.read_text(encoding="utf-8") == md and csv_path.read_text(encoding="utf-8") == to_csv(rows)
    # only the trained teams: files tagged "after"
    _result(a, "tagged", tag="after", method="IPPO", agents=2, roles="named", benchmark="gsm8k", seeds=[0.2])
    assert [r["method"] for r in aggregate([a, b], tags=["after"])] == ["IPPO"]
    with pytest.raises(FileNotFoundError, match=r"tag in \['before'\]"):
        aggregate([a, b], tags=["before"])


def _five(method, agents, roles, bench, mean):
    return dict(method=method, agents=agents, roles=roles, benchmark=bench,
                seeds=[mean - 0.02, mean - 0.01, mean, mean + 0.01, mean + 0.02])


def test_table_paper_layout_formats(tmp_path):
    """Single/Duo/Trio groups in team order, named and anonymous apart, the paper's method
    order within a group, n stated once when every cell has it; Markdown, CSV and LaTeX."""
    runs = tmp_path / "runs"
    for name, rec in {
        "trio_marft": _five("MARFT-A", 3, "named", "arith", 0.40),
        "duo_marft_t": _five("MARFT-T", 2, "named", "arith", 0.30),
        "duo_marft_anon": _five("MARFT-A", 2, "anonymous", "arith", 0.33),
        "duo_marft": _five("MARFT-A", 2, "named", "arith", 0.35),
        "duo_ippo": _five("independent PPO", 2, "named", "arith", 0.20),
        "single": _five("single agent (PPO-A)", 1, "named", "arith", 0.15),
        "odd": _five("my_method 50%", 3, "named", "gsm_8k", 0.10),
    }.items():
        _result(runs / name, "after", **rec)
    rows = aggregate(sorted(runs.iterdir()))
    md = render(rows, "markdown").splitlines()
    assert md[2:9] == ["| Single | single agent (PPO-A) | named | 15.0 ± 0.7 | – |",
                       "| Duo | independent PPO | named | 20.0 ± 0.7 | – |",
                       "|  | MARFT-A | named | 35.0 ± 0.7 | – |",
                       "|  | MARFT-A | anonymous | 33.0 ± 0.7 | – |",
                       "|  | MARFT-T | named | 30.0 ± 0.7 | – |",
                       "| Trio | MARFT-A | named | 40.0 ± 0.7 | – |",
                       "|  | my_method 50% | named | – | 10.0 ± 0.7 |"]
    assert md[-1] == ("Accuracy (%), mean ± standard error over seeds (sample std / √n); n = 5 seeds per cell; "
                      "–: not run.")
    assert [r[0] for r in csv.reader(io.StringIO(render(rows, "csv")))][1:] == \
        ["Single", "Duo", "Duo", "Duo", "Duo", "Trio", "Trio"]
    tex = render(rows, "latex")
    assert "\\begin{tabular}{lllrr}" in tex and tex.count("\\midrule") == 3       # one rule per team group
    assert "Duo & independent PPO & named & 20.0 $\\pm$ 0.7 & -- \\\\" in tex
    assert " & MARFT-A & anonymous & 33.0 $\\pm$ 0.7 & -- \\\\" in tex
    assert " & my\\_method 50\\% & named & -- & 10.0 $\\pm$ 0.7 \\\\" in tex         # escaped
    assert "gsm\\_8k" in tex and "\\caption{Accuracy (\\%), mean $\\pm$ standard error" in tex
    paths = write_table(sorted(runs.iterdir()), tmp_path / "out", formats=["latex", "csv"])
    assert [p.name for p in paths] == ["results.tex", "results.csv"] and paths[0].read_text() == tex
    with pytest.raises(ValueError, match="format must be one of.*'html'"):
        render(rows, "html")
    with pytest.raises(ValueError, match="spread must be one of"):
        render(rows, "markdown", spread="iqr")


def test_table_and_plot_cli(tmp_path, capsys):
    from marft_jax.cli import main
    from tests.synthetic_runs import make_run

    sweep = tmp_path / "sweep"
    for seed in range(3):
        make_run(sweep, f"marft_a-s{seed}", method="MARFT-A", agents=2, seed=seed, before=0.1,
                 periodic={10: 0.2, 20: 0.25}, after=0.3 + 0.01 * seed, share_before=seed > 0)
        make_run(sweep, f"trio_ippo-s{seed}", method="independent PPO", agents=3, seed=seed, before=0.1,
                 periodic={10: 0.12}, after=0.15)
    out = tmp_path / "table"
    assert main(["table", str(sweep), "--tag", "after", "--format", "latex", "--out", str(out)]) == 0
    assert "Trio & independent PPO & named & 15.0 $\\pm$ 0.0" in capsys.readouterr().out
    assert (out / "results.tex").is_file() and not (out / "results.md").exists()
    assert main(["table", str(sweep / "marft_a-s0"), "--out", str(out)]) == 0   # default: Markdown + CSV
    assert (out / "results.md").is_file() and (out / "results.csv").is_file()

    with pytest.raises(SystemExit) as e:
        main(["table", str(sweep), "--format", "html"])
    assert e.value.code == 2 and "--format" in capsys.readouterr().err
    assert main(["table", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    (tmp_path / "empty_run" / "eval").mkdir(parents=True)
    assert main(["table", str(tmp_path / "empty_run"), "--out", str(out)]) == 2
    assert "no eval/*.json result file under" in capsys.readouterr().err

    # one run folder: its own training curves, as before
    with open(sweep / "marft_a-s0" / M.METRICS_FILE, "a") as f:
        f.write(json.dumps({"step": 1, "rewards/planner/mean": 0.5}) + "\n")
    assert main(["plot", str(sweep / "marft_a-s0")]) == 0
    assert (sweep / "marft_a-s0" / "plots" / "reward.png").is_file()
    # a sweep folder (or several runs): one held-out figure
    png = tmp_path / "fig" / "heldout.png"
    assert main(["plot", str(sweep), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "empty_run"), str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_table_schema_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no eval"):
        aggregate([tmp_path])
    _result(tmp_path, "bad", method="MARFT-A", agents=2, roles="nameless", benchmark="x", seeds=[0.5])
    with pytest.raises(ResultsSchemaError, match=r"bad\.json.*'roles'"):
        aggregate([tmp_path])
    _result(tmp_path, "bad", method="MARFT-A", agents=2, roles="named", benchmark="x", seeds=[55.0])
    with pytest.raises(ResultsSchemaError, match=r"accuracies in \[0, 1\]"):
        aggregate([tmp_path])
    _result(tmp_path, "bad", method="MARFT-A", agents=2, roles="named", benchmark="x", seeds=[0.5], seed_ids=[0])
    _result(tmp_path, "dup", method="MARFT-A", agents=2, roles="named", benchmark="x", seeds=[0.6], seed_ids=[0])
    with pytest.raises(ResultsSchemaError, match="seed ids"):
        aggregate([tmp_path])


def test_plot_run_merges_records_of_one_step(tmp_path):
    """The trainer logs an evaluation apart from the iteration's metrics at the same step: both
    stay in the curves."""
    from marft_jax.train.plot import _series

    series = _series([{"step": 1, "episode/accuracy": 0.1}, {"step": 2, "episode/accuracy": 0.2},
                      {"step": 2, "eval/accuracy": 0.5}, {"step": 2, "episode/accuracy": 0.3}])
    assert series["episode/accuracy"] == ([1, 2], [0.1, 0.3]) and series["eval/accuracy"] == ([2], [0.5])


def test_run_records_read_the_trainer_layout(tmp_path):
    from marft_jax.train.run_records import Arm, expand_run_dirs, read_run
    from tests.synthetic_runs import make_run

    shared = make_run(tmp_path / "sweep", "b-s1", method="MARFT-A", agents=2, seed=1, before=0.125,
                      periodic={10: 0.2, 20: 0.25}, after=0.3, iterations=30, share_before=True)
    rec = read_run(shared)
    assert rec.arm == Arm("MARFT-A", 2, "named") and rec.seed == 1 and rec.finished
    assert rec.curve == {0: 0.125, 10: 0.2, 20: 0.25, 30: 0.3} and rec.benchmark == "arithmetic"
    assert len(rec.train_reward) == 30 and rec.train_reward[1] == pytest.approx(0.1)
    running = make_run(tmp_path / "sweep", "a-s0", method="MARFT-T", agents=2, periodic={10: 0.2}, after=None)
    rec = read_run(running)                    # still training: untrained + periodic evaluations only
    assert not rec.finished and rec.curve == {0: 0.1, 10: 0.2} and rec.arm == Arm("MARFT-T", 2, "named")
    (tmp_path / "sweep" / "notes").mkdir()     # not a run folder: skipped in a sweep folder
    assert [p.name for p in expand_run_dirs([tmp_path / "sweep"])] == ["a-s0", "b-s1"]
    assert expand_run_dirs([running]) == [running]
    with pytest.raises(FileNotFoundError, match="notes.*neither a run folder"):
        expand_run_dirs([tmp_path / "sweep" / "notes"])


def test_heldout_plot_mean_and_bands(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from marft_jax.train.sweep_plot import mean_band, plot_heldout
    from tests.synthetic_runs import make_run

    xs, means, ses, counts = mean_band([{0: 0.1, 10: 0.2}, {0: 0.1, 10: 0.4}, {0: 0.1}])
    assert xs == [0, 10] and means == pytest.approx([0.1, 0.3]) and counts == [3, 2]
    assert ses == pytest.approx([0.0, 0.1])               # sample std 0.1414 / sqrt(2)

    for seed, after in enumerate([0.3, 0.35, 0.4]):
        make_run(tmp_path / "runs", f"a-s{seed}", method="MARFT-A", agents=2, seed=seed, periodic={10: 0.2}, after=after)
        make_run(tmp_path / "runs", f"i-s{seed}", method="independent PPO", agents=2, seed=seed, after=0.2)
    make_run(tmp_path / "other", "t-s0", method="MARFT-A", agents=3, after=0.5)     # one seed: no band
    bands = []
    real = Axes.fill_between
    monkeypatch.setattr(Axes, "fill_between", lambda self, x, lo, hi, **kw: (bands.append((list(x), list(lo), list(hi))),
                                                                             real(self, x, lo, hi, **kw))[1])
    png = plot_heldout([tmp_path / "runs", tmp_path / "other" / "t-s0"], tmp_path / "fig.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(bands) == 3                                # one band per method
    x, lo, hi = bands[1]                                  # MARFT-A · Duo (after IPPO in the table's order)
    assert x == [0, 10, 30]
    se = 100 * np.std([0.3, 0.35, 0.4], ddof=1) / math.sqrt(3)
    assert hi[2] - lo[2] == pytest.approx(2 * se) and hi[1] == pytest.approx(20.0) == lo[1]
    assert bands[2][1] == bands[2][2]                     # Trio: one seed, a zero-width band
    (tmp_path / "bare" / "x-s0").mkdir(parents=True)
    (tmp_path / "bare" / "x-s0" / "config.yaml").write_text("train: {seed: 0}\n")
    with pytest.raises(ValueError, match="no run under.*bare.*has a trained evaluation"):
        plot_heldout([tmp_path / "bare"], tmp_path / "none.png")


def test_stats_mean_se_and_bootstrap():
    from marft_jax.train import repro_stats as S

    m, se = S.mean_se([0.1, 0.2, 0.3, 0.4, 0.5])
    assert m == pytest.approx(0.3) and se == pytest.approx(math.sqrt(0.025) / math.sqrt(5))
    assert math.isnan(S.mean_se([0.4])[1]) and math.isnan(S.sample_std([0.4]))

    high = [0.30, 0.32, 0.31, 0.33, 0.29]
    low = [0.10, 0.12, 0.11, 0.09, 0.10]
    c = S.contrast([high, low], [1, -1])
    assert c["estimate"] == pytest.approx(0.206) and 0 < c["low"] < c["estimate"] < c["high"]
    assert S.verdict(c, "above IPPO", "below IPPO") == "above IPPO"
    assert S.verdict(S.contrast([low, high], [1, -1]), "above IPPO", "below IPPO") == "below IPPO"
    # the same numbers in another order: the interval must hold 0
    same = S.contrast([[0.1, 0.3, 0.2, 0.0, 0.4], [0.4, 0.0, 0.3, 0.1, 0.2]], [1, -1])
    assert same["low"] < 0 < same["high"] and S.verdict(same, "a", "b") == S.NOT_SEPARATED
    # seeded: the same interval again; another seed, another (close) interval
    assert S.contrast([high, low], [1, -1]) == c
    other = S.contrast([high, low], [1, -1], seed=1)
    assert other != c and other["low"] == pytest.approx(c["low"], abs=0.01)
    # the percentile interval of a mean of 2 values resampled: exactly the 2.5/97.5 % points
    lo, hi = S.bootstrap([[0.0, 1.0]], lambda d: d[0].mean(axis=1), resamples=4000)
    assert (lo, hi) == (0.0, 1.0)
    # one seed: no interval, never a verdict of separation
    one = S.contrast([[0.9], low], [1, -1])
    assert one["low"] is None and S.verdict(one, "a", "b") == S.TOO_FEW
    two = S.contrast([[0.9, 0.8], low], [1, -1])          # two seeds: the bootstrap spans only their combinations
    assert two["low"] is None and S.verdict(two, "a", "b") == S.TOO_FEW
    assert S.spread_difference([0.5], low)["low"] is None


def test_stats_seed_summary_and_sweep_report():
    from marft_jax.train import repro_stats as S

    s = S.seed_summary([0.1, 0.1, 0.1], [0.2, 0.4, 0.3])
    assert s["n"] == 3 and s["change_mean_pp"] == pytest.approx(20.0)
    assert s["change_se_pp"] == pytest.approx(10 / math.sqrt(3)) and s["change_std_pp"] == pytest.approx(10.0)
    assert s["worst_change_pp"] == pytest.approx(10.0) and s["before_se_pp"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="3 accuracies before but 2 after"):
        S.seed_summary([0.1] * 3, [0.2] * 2)

    steady = [0.20, 0.21, 0.19, 0.20, 0.21]
    changes = {"a": steady, "t": [0.0, 0.4, 0.1, 0.35, 0.05], "ippo": [0.05, 0.04, 0.06, 0.05, 0.05],
               "trio_a": [0.40, 0.41, 0.39, 0.40, 0.41], "trio_ippo": [0.05, 0.04, 0.06, 0.05, 0.05],
               "anon": [0.18, 0.22, 0.20, 0.19, 0.21]}
    r = S.sweep_report(changes, baselines={"a": "ippo", "t": "ippo", "trio_a": "trio_ippo", "missing": "ippo"},
                       spread_pairs=[("a", "t")], margin_pairs=[(("a", "ippo"), ("trio_a", "trio_ippo"))],
                       differences=[("a", "anon")], names={"a": "MARFT-A", "t": "MARFT-T"})
    assert set(r["vs_baseline"]) == {"a", "t", "trio_a"}                      # absent methods skipped
    assert r["vs_baseline"]["a"]["estimate_pp"] == pytest.approx(15.2) and r["vs_baseline"]["a"]["verdict"] == "above IPPO"
    assert r["vs_baseline"]["t"]["verdict"] == "not separated"                # large spread
    (sp,) = r["spread"]
    assert sp["verdict"] == "MARFT-A steadier" and sp["high_pp"] < 0 and sp["worst_b_pp"] == pytest.approx(0.0)
    (mg,) = r["margin"]
    assert mg["margin_large_pp"] == pytest.approx(35.2) and mg["margin_small_pp"] == pytest.approx(15.2)
    assert mg["estimate_pp"] == pytest.approx(20.0) and mg["verdict"] == "margin wider"
    (d,) = r["differences"]
    assert d["estimate_pp"] == pytest.approx(0.2) and d["verdict"] == "not separated"
    json.dumps(r)                                                              # plain numbers
