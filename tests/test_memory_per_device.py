"""experiments/memory_per_device.py: the buffer-assignment reader, and the whole script on a tiny
model of the Qwen2 family over 2 simulated CPU devices (one subprocess)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "experiments" / "memory_per_device.py"


def _load():
    spec = importlib.util.spec_from_file_location("memory_per_device", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BUFFERS = """\
allocation 0: size 1024, parameter 0, shape |bf16[4,128]| at ShapeIndex {}:
 value: <1 param.0 @0> (size=1024,offset=0): bf16[4,128]{1,0}
allocation 1: size 64, parameter 1, shape |f32[16]| at ShapeIndex {}:
 value: <2 param.1 @0> (size=64,offset=0): f32[16]{0}
allocation 2: size 6144, preallocated-temp:
 value: <3 wrapped_convert.1 @0> (size=2048,offset=0): f32[4,128]{1,0}
 value: <4 fusion.2 @0> (size=4096,offset=2048): f32[8,128]{1,0}
 value: <5 fusion.3 @0> (size=4096,offset=2048): f32[1024]{0}
 value: <6 wrapped_convert.7 @0> (size=64,offset=0): f32[16]{0}
"""


def test_explain_buffers_names_the_largest_temps_and_the_f32_copies_of_bf16_arguments():
    mod = _load()
    out = mod.explain_buffers(BUFFERS, top=2)
    assert out["largest_temp"][0].startswith("fusion.2 f32[8,128]")   # one entry per placement
    assert len(out["largest_temp"]) == 2 and out["largest_temp"][1].startswith("wrapped_convert.1 f32[4,128]")
    # f32[4,128] converts a bf16 argument; f32[16] converts an f32 argument (not a copy)
    assert out["cpu_f32_copies"] == 2048
    assert mod.explain_buffers("no allocations") == {"largest_temp": [], "cpu_f32_copies": 0}


@pytest.mark.multidevice
def test_memory_per_device_on_two_simulated_devices():
    argv = ["--model", "tiny", "--devices", "2", "--meshes", "1,2,1", "--teams", "duo", "--variants", "cpu",
            "--programs", "update", "sampler_prefill", "--set", "rollout.rows=4",
            "--set", "rollout.context_window=64", "--set", "rollout.max_new_tokens=16", "--set", "ppo.micro_batches=2"]
    out = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert "| duo | 1x2x1 | update |" in out.stdout
    run = report["teams"]["duo"]["meshes"]["1,2,1"]
    assert run["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1} and not run["errors"]
    assert set(run["programs"]) == {"update", "sampler_prefill"}
    for b in run["programs"].values():
        assert b["planned"] == b["argument"] + b["output"] - b["alias"] + b["temp"] + b["generated_code"] > 0
        assert b["largest_temp"]
    assert report["model_config"] == _load().TINY
    # bf16 (2 bytes a parameter) halved by fsdp=2; only the q/k/v biases (no embedding axis) stay whole
    assert report["num_params"] < run["resident"]["base"] < 1.05 * report["num_params"]
    assert run["resident"]["lora_and_adamw"] > 0 and run["resident"]["kv_cache"] > 0
    assert run["shapes"]["sampler_batch"] == 4 and run["shapes"]["prompt_bucket"] == 64
    settings = report["teams"]["duo"]["settings"]
    assert settings["agents"] == 2 and settings["base_dtype"] == "bfloat16" and settings["context_tokens"] == 48
