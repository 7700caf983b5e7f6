"""Every program of a run lowers for ``cuda`` and ``tpu``, on 1 device and on (data, fsdp, tensor)
meshes of 4 and 8 simulated devices, without an accelerator (issue 37).

The cases (tests/lowering_cases.py, through :mod:`marft_jax.preflight`): a tiny model at a real
run's lengths (prompt buckets 16, 64 and 640; packed rows of 160, 640 and an odd 97 slots; a
planner-chosen shape), prefill, the prefill after a reused prompt prefix and every decode phase, the feature + backup program, the
log-prob recompute, the PPO update with its gradient, the concurrent agents' ``vmap`` and
evaluation, with ``model.attention=auto`` and each other implementation of the platform
(cuda: cudnn, pallas, xla; tpu: splash, pallas, xla). TPU programs are exported with
``jax.export`` (Mosaic kernels must be wrapped in ``shard_map`` there), CUDA ones lowered with
``lowering_platforms=('cuda',)``. One subprocess per device count runs all its cases.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import lowering_cases
from tests.xla_env import device_env

DEVICES = (1, 4, 8)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict]]:
    """The cases of every device count, their subprocesses run side by side."""
    model_dir = tmp_path_factory.mktemp("tiny-qwen2")
    (model_dir / "config.json").write_text(json.dumps(lowering_cases.TINY_MODEL))
    procs = {d: subprocess.Popen([sys.executable, "-m", "tests.lowering_cases", str(d), str(model_dir)], cwd=ROOT,
                                 env=device_env(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for d in DEVICES}
    out = {}
    for d, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, f"{d}-device lowering subprocess failed:\n{stderr[-4000:]}"
        out[d] = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return out


def describe(case: dict) -> str:
    return (f"{case['platform']} x {case['devices']}: {case['program']} [{case['shape']}] "
            f"attention={case['attention']}: {case['error']}")


@pytest.mark.parametrize("devices", DEVICES)
def test_every_program_lowers_for_cuda_and_tpu(results, devices):
    failed = [describe(c) for c in results[devices] if not c["ok"]]
    assert not failed, f"{len(failed)} of {len(results[devices])} cases do not lower:\n" + "\n".join(failed)


def test_the_cases_cover_a_run(results):
    """What the lowering test claims to cover is what it lowered (on every device count)."""
    for devices, cases in results.items():
        covered = {(c["platform"], c["attention"]) for c in cases}
        assert covered == {("cuda", "cudnn"), ("cuda", "pallas"), ("cuda", "xla"),
                           ("tpu", "splash"), ("tpu", "pallas"), ("tpu", "xla")}, devices
        assert {c["attention"] for c in cases if c["auto"]} == {"cudnn", "splash"}
        for platform, kernel in (("cuda", "cudnn"), ("cuda", "pallas"), ("tpu", "splash"), ("tpu", "pallas")):
            mine = [c for c in cases if c["platform"] == platform and c["attention"] == kernel]
            prompts = {c["shape"].split(" x ")[1] for c in mine if c["program"] == "prefill"}
            assert prompts == {"16 tokens", "64 tokens", "640 tokens"}, (platform, kernel, prompts)
            for length in lowering_cases.ROW_LENGTHS:      # forwards at every length, odd 97 included
                at = {c["program"] for c in mine if c["shape"].startswith(f"rows of {length}:")}
                assert {"features+backup", "recompute"} <= at, (platform, kernel, length, at)
            grads = {c["shape"].split(":")[0] for c in mine if c["program"].startswith("update")}
            auto = kernel in ("cudnn", "splash")
            assert {"rows of 160", "rows of 97"} | ({"rows of 640"} if auto else set()) <= grads, (platform, kernel)
            assert any(c["program"] == "update (concurrent agents)" for c in mine), (platform, kernel)
        auto = {c["program"] for c in cases if c["auto"]}
        assert {"decode", "prefill after prefix", "eval prefill", "eval decode"} <= auto, (devices, auto)
        for platform in ("cuda", "tpu"):       # the critic-free estimator's run: backup, no feature pass
            group = [c for c in cases if c["platform"] == platform and c["estimator"] == "group"]
            programs = {c["program"] for c in group}
            assert "backup" in programs and "features+backup" not in programs, (devices, platform, programs)
            assert any(c["program"].startswith("update") and c["shape"].startswith("group, rows of 97")
                       for c in group), (devices, platform)
