"""experiments/device_check.py: its CPU run (CI), the budget, the per-part processes, and the
wheels it carries to a machine that cannot install anything."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_check", ROOT / "experiments" / "device_check.py")
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)

PART_NAMES = [name for name, _, _ in device_check.PARTS]


def _run(*args: str, timeout: float = 300) -> tuple[list[dict], float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "experiments/device_check.py", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()], time.monotonic() - t0


def test_device_check_small_prints_one_json_line_per_part_then_the_summary():
    lines, _ = _run("--small")
    assert [x.get("part") for x in lines[:-1]] == PART_NAMES and lines[-1]["summary"] is True
    parts = {x["part"]: x for x in lines[:-1]}
    assert all(p["ok"] for p in parts.values()), {n: p.get("reason") for n, p in parts.items()}
    env = parts["environment"]["result"]
    assert env["versions"]["jax"] == jax.__version__ and env["backend"] == "cpu" and env["attention_auto"] == "xla"
    assert "jax:" in env["environment_info"]
    att = parts["attention"]["result"]
    assert att["implementations"] == ["xla"] and sorted(att["lengths"], key=int) == ["16", "64", "160"]
    for row in att["lengths"].values():
        assert row["xla"]["fwd_max_abs_err"] < 1e-5 and row["xla"]["grad_rel_err"] < 1e-5
        assert row["xla"]["fwd_ms"] > 0 and row["xla"]["fwd_grad_ms"] > 0
    par = parts["parity"]["result"]
    assert par["kl_max"] < 1e-6 and par["greedy_agreement"] == 1.0     # float32 against HF float32
    point = parts["sampler"]["result"]["points"]["b4_p16"]
    assert point["tokens_per_s"] > 0 and 0 < point["decode_hbm_fraction"]
    upd = next(iter(parts["update"]["result"]["models"].values()))
    assert 0 < upd["mfu"] <= upd["hfu"] < 1 and len(upd["steps_s"]) == 3
    it = parts["iteration"]["result"]["iterations"][0]
    assert it["seconds"] > 0 and {"rollout", "update"} <= set(it["stages_s"]) and it["compiles"] > 0
    assert all(p["peak_device_memory_bytes"] is None for p in parts.values())      # the CPU reports none
    assert lines[-1]["parts"].keys() == set(PART_NAMES) and lines[-1]["results"]["parity"] == par


def test_the_budget_skips_parts_and_a_part_runs_in_its_own_process():
    """``--budget-s 0`` skips every part (the parent starts no JAX backend, so this is quick);
    without ``--in-process`` a part runs in a child process and reports through it."""
    lines, secs = _run("--budget-s", "0", timeout=120)
    assert [x.get("part") for x in lines[:-1]] == PART_NAMES
    assert all(x["skipped"] and x["reason"].startswith("budget") for x in lines[:-1]) and secs < 30
    others = ",".join(PART_NAMES[1:])
    lines, _ = _run("--small", "--no-in-process", "--skip", others, timeout=120)
    env = lines[0]
    assert env["part"] == "environment" and env["ok"] and env["result"]["device_kind"] == "cpu"
    assert "peak_device_memory_cumulative" not in env and lines[-1]["in_process"] is False


def test_cudnn_packed_layout_of_segment_ids():
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 3, 3, 3, 3]], np.int32)
    seqlen, offsets = device_check.packed_lengths_offsets(jax.numpy.asarray(seg), 4)
    np.testing.assert_array_equal(seqlen, [[3, 2, -1, -1], [1, 1, 4, -1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, 1, 2, 6, -1]])


def test_carried_wheels_are_pinned_to_the_versions_we_test_with():
    pins = [line.split("#")[0].strip() for line in (ROOT / "experiments" / "device_check_wheels.txt").read_text()
            .splitlines()]
    pins = [p for p in pins if p]
    assert pins, "no wheels pinned"
    for pin in pins:
        name, _, version = pin.partition("==")
        assert version and metadata.version(name) == version, pin
