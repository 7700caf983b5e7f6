"""Each device does its 1/D share of the work, and the results stay the single-device ones.

Every check runs :mod:`tests.multidevice_split` in a subprocess with D simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=D``, fixed when JAX starts), which compiles
the stage on one device and on a data-only mesh of D. Per-device FLOPs are XLA's cost analysis
of the partitioned program.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_env import device_env


ROOT = Path(__file__).resolve().parents[1]


def _check(name: str, devices: int) -> dict:
    env = device_env(devices)
    out = subprocess.run([sys.executable, "-m", "tests.multidevice_split", name], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-6000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["devices"] == devices
    return report


@pytest.mark.multidevice
def test_each_device_computes_its_share_of_every_micro_batch():
    """ppo.micro_batches = D on a data-only mesh of D, packed rows (a training run's layout):
    micro-batch v's rows lived on device v and the scan gathered them whole onto every device
    (per-device FLOPs 0.83 of one device's here before the split; goal 1.2 / D = 0.3). The
    padded layout split already (0.29 here)."""
    d = 4
    r = _check("update_micro_packed", d)
    assert r["flops_1_device"] > 0
    assert r["flops_per_device"] <= 1.2 / d * r["flops_1_device"], r
    assert r["changed"] > 1e-3, r                 # the update moved the adapters ...
    assert r["max_abs_diff"] <= 1e-5, r           # ... to the single-device result


@pytest.mark.multidevice
def test_sampler_resize_keeps_the_cache_split_over_the_rows():
    """The cache grows in ``resize`` between decode phases. Its gather of the working rows used
    to return the cache whole on every device, so the next phase decoded every row on every
    device (per-device decode FLOPs 1.0 of one device's here before)."""
    d = 4
    r = _check("sampler_resize", d)
    rows = r["1_device"]["k_shape"][1]
    assert r["mesh"]["k_shard_shape"][1] == rows // d, r            # [layer, batch, kv, slot, dim]
    assert r["mesh"]["valid_shard_shape"][0] == rows // d, r
    # (d/2, 1, 2): rows over data, and the kv heads stay split over tensor
    assert r["tensor"]["k_shard_shape"][1:3] == [rows // (d // 2), r["1_device"]["k_shape"][2] // 2], r
    assert r["flops_per_device"] <= 1.2 / d * r["flops_1_device"], r
    assert r["max_abs_diff"] == 0, r                                # greedy tokens identical
    # no row finished, so the cache only grew: each device padded its own rows, nothing gathered
    for label in ("mesh", "tensor"):
        assert not r[label]["compacted"] and r[label]["resize_all_gathers"] == 0, r


@pytest.mark.multidevice
def test_feature_pass_reads_the_decision_points_without_gathering_every_hidden_state():
    """The critic feature pass runs in several calls (``lax.map``) of packed rows split over the
    data shards. Flattening the calls end to end before the gather made XLA all-gather every
    hidden state onto every device (one all-gather of the whole ``[calls, slots, H]`` here);
    gathered per (call, slot), each device reads its own slots and one all-reduce of the small
    result combines them. (The FLOPs split is not asserted here: XLA's cost analysis counts the
    ``lax.map`` body once, one call's rows, which the 1-device program packs differently.)"""
    d = 4
    r = _check("feature_gather", d)
    assert r["mesh"]["calls"][0][0] > 1, r                          # several calls per class
    assert r["mesh"]["all_gathers"] == 0, r                         # 1 before
    assert r["max_abs_diff"] <= 1e-5, r
