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
from marft_jax.train.table import ResultsSchemaError, aggregate, to_csv, to_markdown, write_table


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

    md = to_markdown(rows)
    lines = md.splitlines()
    assert lines[0] == "| method | agents | roles | arithmetic-l1 | gsm8k |"
    assert lines[2] == "| MARFT-A | 2 | named | 60.0 ± 8.2 | 30.0 ± 0.0 |"
    assert lines[3] == "| MARFT-A | 2 | anonymous | 45.0 ± 5.0 | – |"
    assert lines[4] == "| base | 1 | named | – | 20.0 ± 8.2 |"
    table = list(csv.reader(io.StringIO(to_csv(rows))))
    assert table[0] == ["method", "agents", "roles", "arithmetic-l1", "gsm8k"]
    assert table[1] == ["MARFT-A", "2", "named", "60.0 ± 8.2", "30.0 ± 0.0"]
    md_path, csv_path = write_table([a, b], tmp_path / "out")
    assert md_path.read_text(encoding="utf-8") == md and csv_path.read_text(encoding="utf-8") == to_csv(rows)


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
