"""experiments/cpu_repro.py end to end on a tiny random model: runs, table, CSV, reuse."""

from __future__ import annotations

import csv
import json
import importlib.util
from pathlib import Path

from tests.tiny_run import make_tiny_model_dir, tiny_overrides

REPO = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("cpu_repro", REPO / "experiments" / "cpu_repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_repro_writes_table_and_reuses_finished_runs(tmp_path):
    cpu_repro = _load()
    model = make_tiny_model_dir(tmp_path / "model")
    over = tiny_overrides(model, tmp_path, "ignored", **{"train.iterations": 2})
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

    stamp = (tmp_path / "runs" / "marft_a-s0" / "metrics.jsonl").stat().st_mtime_ns
    again = cpu_repro.main(argv)                      # finished runs are reused, not retrained
    assert (tmp_path / "runs" / "marft_a-s0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert [r["accuracy_after"] for r in again] == [r["accuracy_after"] for r in rows]


def test_untrained_evaluation_is_shared_where_identical():
    cpu_repro = _load()
    from marft_jax.config import load_config

    keys = {m: cpu_repro.untrained_key(load_config(f"cpu_repro/{m}", [f"train.seed={s}"]))
            for m in cpu_repro.METHODS for s in (0, 1)}
    assert keys["marft_a"] == keys["marft_t"]
    assert len({keys["marft_a"], keys["ippo"], keys["single"]}) == 3
