"""Smoke test of the update benchmark on a tiny random model (ours, the PyTorch baseline, --no-cache)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from marft_jax.bench import update as bench  # noqa: E402

KEYS = {"ours_s", "baseline_s", "ratio", "compile_s", "shapes", "model", "tokens_per_update",
        "ours_flops_per_s", "ours_mfu", "jax_matmul_roofline_flops_per_s", "feature_cache_saving_s",
        "jax_version", "torch_version", "cpu_cores", "machine",
        "baseline_breakdown_s", "logp_parity_max_abs"}


def test_bench_update_tiny(capsys):
    report = bench.main(["--model", "tiny-test", "--batch", "2", "--ctx", "8", "--act", "8", "--repeats", "1",
                         "--roofline-n", "128", "--torch-threads", "1"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(printed), sorted(KEYS - set(printed))
    assert printed["tokens_per_update"] == 2 * 2 * (8 + 8)
    assert printed["shapes"]["agents"] == 2 and printed["shapes"]["seq_len"] == 16
    for k in ("ours_s", "baseline_s", "ratio", "compile_s", "feature_cache_saving_s"):
        assert np.isfinite(report[k]) and report[k] > 0, k
    # both sides compute the same model: the baseline's first log-probs equal our logp_old
    assert report["logp_parity_max_abs"] < 1e-3
    assert report["ours_metrics"]["updated"] == [1.0, 1.0]


@pytest.mark.slow
def test_bench_update_no_cache_tiny():
    report = bench.main(["--model", "tiny-test", "--batch", "2", "--ctx", "8", "--act", "8", "--repeats", "1",
                         "--roofline-n", "128", "--no-baseline", "--no-cache"])
    assert "baseline_s" not in report
    assert np.isfinite(report["ours_no_cache_s"]) and report["ours_no_cache_s"] > 0
    assert report["no_cache_compile_s"] > 0
