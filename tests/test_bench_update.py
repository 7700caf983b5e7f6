"""Smoke test of the update benchmark on a tiny random model (ours, the PyTorch baseline, --no-cache).

With its PyTorch baseline the benchmark runs as a user runs it, ``python -m
marft_jax.bench.update``, in its own process: it builds and runs the torch baseline, then compiles
XLA programs. Run inside a pytest-xdist worker, after the worker's earlier files, that XLA compile
segfaulted twice (2026-12-06, ``Ours.__init__``'s ``lowered.compile()``; never in 8 standalone
runs), and the crashed worker left pytest-xdist (``--dist loadfile``) waiting for ever. In its own
process a crash fails this test with the benchmark's output, and the suite goes on. Without the
baseline (no torch) it runs in the test's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny-test", "--batch", "2", "--ctx", "8", "--act", "8", "--repeats", "1", "--roofline-n", "128"]
KEYS = {"ours_s", "baseline_s", "ratio", "compile_s", "shapes", "model", "tokens_per_update",
        "ours_flops_per_s", "ours_mfu", "jax_matmul_roofline_flops_per_s", "feature_cache_saving_s",
        "jax_version", "torch_version", "cpu_cores", "machine",
        "baseline_breakdown_s", "logp_parity_max_abs"}


def _bench(*args: str) -> dict:
    """The report the benchmark prints as its last stdout line (asserting it exits 0)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "marft_jax.bench.update", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_update_tiny():
    report = _bench(*TINY, "--torch-threads", "1")
    assert KEYS <= set(report), sorted(KEYS - set(report))
    assert report["tokens_per_update"] == 2 * 2 * (8 + 8)
    assert report["shapes"]["agents"] == 2 and report["shapes"]["seq_len"] == 16
    for k in ("ours_s", "baseline_s", "ratio", "compile_s", "feature_cache_saving_s"):
        assert np.isfinite(report[k]) and report[k] > 0, k
    # both sides compute the same model: the baseline's first log-probs equal our logp_old
    assert report["logp_parity_max_abs"] < 1e-3
    assert report["ours_metrics"]["updated"] == [1.0, 1.0]


@pytest.mark.slow
def test_bench_update_no_cache_tiny(capsys):
    from marft_jax.bench import update as bench

    report = bench.main([*TINY, "--no-baseline", "--no-cache"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(report))
    assert "baseline_s" not in report and "torch_version" not in report
    assert np.isfinite(report["ours_no_cache_s"]) and report["ours_no_cache_s"] > 0
