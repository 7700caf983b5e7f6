"""Start-up of the device world: ``jax.distributed`` across processes, the run's mesh, and what
each process sees.

Nothing here launches processes or moves data between them: every process runs the same
command (SLURM ``srun``, a TPU pod's ``--worker=all``, or one command per host), JAX connects
them (:func:`initialize`), and XLA does every collective from the shardings that
:mod:`marft_jax.models.sharding` and :mod:`marft_jax.models.placement` give the arrays.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Callable

import jax
from jax.sharding import Mesh

from marft_jax.config import ConfigError, DistSection, MeshSection
from marft_jax.models import sharding
from marft_jax.models.config import ModelConfig

# Environment markers of the clusters jax.distributed detects by itself, with more than one
# process (one SLURM task or a single TPU VM is a one-process run and needs no coordinator).
_CLUSTER_MARKERS = {
    "SLURM": lambda env: int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1
    and "SLURM_JOB_ID" in env,
    "Open MPI": lambda env: int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1,
    "TPU pod slice": lambda env: "," in env.get("TPU_WORKER_HOSTNAMES", "")
    or "MEGASCALE_COORDINATOR_ADDRESS" in env,
    "Kubernetes JobSet": lambda env: "KUBERNETES_SERVICE_HOST" in env and "JOBSET_NAME" in env,
}


@dataclasses.dataclass(frozen=True)
class InitDecision:
    """What :func:`initialize` will do: ``why`` says it in words (logged)."""

    initialize: bool
    why: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """What JAX's own Cloud TPU detection found on this host: ``processes`` hosts in all
    (workers per slice x slices), or ``None`` with ``error`` when the metadata could not be read."""

    processes: int | None
    error: str | None = None


def detect_cloud_tpu_slice() -> TpuSlice | None:
    """JAX's GCE TPU VM detection (``jax._src.clusters.cloud_tpu_cluster.GceTpuCluster``), the
    one ``jax.distributed.initialize()`` runs with no arguments: on a TPU VM (``libtpu`` and
    local TPU chips, found when ``jax`` is imported) it asks the VM's metadata server for this
    worker's number and the slice's worker list; no environment variable says so.

    Returns ``None`` off a Cloud TPU VM (no network request is made), else a :class:`TpuSlice`.
    Never raises: a private JAX API that moved or a metadata server that does not answer is
    reported in ``TpuSlice.error``.
    """
    try:
        from jax._src import cloud_tpu_init

        if not getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False):
            return None
        if os.environ.get("TPU_SKIP_MDS_QUERY") is not None:
            return None
        from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster

        if not GceTpuCluster.is_env_present():
            return TpuSlice(None, "the metadata server has no agent-worker-number")
        return TpuSlice(int(GceTpuCluster.get_process_count()))
    except Exception as e:   # absent module (JAX moved it), requests missing, metadata unreachable
        return TpuSlice(None, f"{type(e).__name__}: {e}"[:300])


def decide_initialize(dist: DistSection, env: dict | None = None,
                    detect_tpu: Callable[[], TpuSlice | None] | None = detect_cloud_tpu_slice) -> InitDecision:
    """Decide whether and how to call ``jax.distributed.initialize`` (pure but for
    ``detect_tpu``, which runs only when nothing in ``dist`` or ``env`` decides).

    Order: ``dist.initialize=off``; an explicit coordinator (config, then
    ``JAX_COORDINATOR_ADDRESS``); a multi-process cluster named by the environment (SLURM, Open
    MPI, a GKE TPU slice, a JobSet); ``dist.initialize=on``; else ``detect_tpu()`` (a GCE TPU
    VM slice, found through the metadata server, not the environment): several hosts -> let
    JAX detect the coordinator, count and index itself; one host or no TPU VM -> one process.
    """
    env = dict(os.environ if env is None else env)
    coordinator = dist.coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    num = dist.num_processes if dist.num_processes is not None else _int_env(env, "JAX_NUM_PROCESSES")
    pid = dist.process_id if dist.process_id is not None else _int_env(env, "JAX_PROCESS_ID")
    if dist.initialize == "off":
        return InitDecision(False, "dist.initialize=off: one process")
    if coordinator is not None:
        if ":" not in coordinator:
            raise ConfigError(f"dist.coordinator={coordinator!r}: must be host:port")
        return InitDecision(True, f"coordinator {coordinator}", coordinator, num, pid)
    found = [name for name, present in _CLUSTER_MARKERS.items() if present(env)]
    if dist.initialize == "on" or found:
        why = f"detected {found[0]}" if found else "dist.initialize=on"
        return InitDecision(True, why, None, num, pid)
    tpu = detect_tpu() if detect_tpu is not None else None
    if tpu is None:
        return InitDecision(False, "no coordinator and no multi-process cluster detected: one process")
    if tpu.processes is None:
        return InitDecision(False, f"Cloud TPU VM, but JAX's slice detection failed ({tpu.error}): one process; "
                               "on a multi-host slice set dist.initialize=on or dist.coordinator")
    if tpu.processes > 1:
        return InitDecision(True, f"detected a Cloud TPU VM slice of {tpu.processes} hosts (JAX's metadata detection)",
                        None, num, pid)
    return InitDecision(False, "single-host Cloud TPU VM: one process")


def _int_env(env: dict, name: str) -> int | None:
    v = env.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r}: must be an integer") from None


def initialize(dist: DistSection) -> InitDecision:
    """Connect this process to the others when the plan says so (once per process)."""
    plan = decide_initialize(dist)
    if plan.initialize and not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=plan.coordinator, num_processes=plan.num_processes,
                                   process_id=plan.process_id, initialization_timeout=dist.timeout_s,
                                   heartbeat_timeout_seconds=dist.heartbeat_timeout_s)
    return plan


COMPILATION_CACHE_MIN_COMPILE_S = 0.5   # programs that compile faster are not worth a disk entry
OFF = ("off", "", "false", "none")     # YAML and the override parser read `off` as false


def compilation_cache_dir(setting: str, backend: str, env: dict | None = None) -> str | None:
    """Where JAX's persistent compilation cache goes for ``train.compilation_cache_dir=setting``
    on ``backend`` (None: off). Pure: reads ``env`` (default ``os.environ``).

    ``auto``: on GPU / TPU ``<cache>/xla`` where ``<cache>`` is the native kernels' cache
    (:mod:`marft_jax.native_build`: ``$MARFT_JAX_CACHE``, else ``$XDG_CACHE_HOME/marft_jax``,
    else ``~/.cache/marft_jax``), shared by
    every run on the machine (a rerun, a resume or the next sweep point skips the minutes of
    compiling a billion-parameter model's programs); on the CPU off (its programs compile in
    seconds, and the tests compare compile counts). ``off`` or ``""``: off. Anything else: that
    directory, on every backend.
    """
    env = dict(os.environ if env is None else env)
    if setting.strip().lower() in OFF:
        return None
    if setting != "auto":
        return os.path.expanduser(setting)
    if backend == "cpu":
        return None
    if env.get("MARFT_JAX_CACHE"):
        return os.path.join(env["MARFT_JAX_CACHE"], "xla")
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "marft_jax", "xla")


def enable_compilation_cache(setting: str, backend: str | None = None) -> str | None:
    """Point ``jax_compilation_cache_dir`` at :func:`compilation_cache_dir` (call before the
    run's first compile). A directory already set for JAX (``JAX_COMPILATION_CACHE_DIR``, a
    caller's ``jax.config``) wins over ``auto`` and is left as it is. Returns the directory in
    use, or None."""
    backend = backend or jax.default_backend()
    preset = jax.config.jax_compilation_cache_dir
    if setting == "auto" and preset:
        return preset
    path = compilation_cache_dir(setting, backend)
    if path is None or path == preset:
        return path
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", COMPILATION_CACHE_MIN_COMPILE_S)
    # JAX decides once per process, at its first compile, whether the cache is used: a program
    # compiled before this call (another run in the same process) would leave it off.
    try:
        from jax.experimental.compilation_cache import compilation_cache as jax_cache

        jax_cache.reset_cache()
    except (ImportError, AttributeError):   # a JAX without it: the first compile comes after this call anyway
        pass
    return path


def mesh_shape(mesh_cfg: MeshSection, num_devices: int) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)`` with the ``-1`` axis resolved; errors name the ``mesh.*`` keys."""
    axes = {"mesh.data": mesh_cfg.data, "mesh.fsdp": mesh_cfg.fsdp, "mesh.tensor": mesh_cfg.tensor}
    fixed = 1
    for v in axes.values():
        fixed *= v if v != -1 else 1
    rest = [k for k, v in axes.items() if v == -1]
    if rest:
        if num_devices % fixed:
            others = ", ".join(f"{k}={v}" for k, v in axes.items() if v != -1)
            raise ConfigError(f"{rest[0]}=-1: {num_devices} devices are not divisible by {others} "
                              f"(product {fixed})")
        axes[rest[0]] = num_devices // fixed
    shape = (axes["mesh.data"], axes["mesh.fsdp"], axes["mesh.tensor"])
    if shape[0] * shape[1] * shape[2] != num_devices:
        raise ConfigError(f"mesh.data={shape[0]} x mesh.fsdp={shape[1]} x mesh.tensor={shape[2]} = "
                          f"{shape[0] * shape[1] * shape[2]} devices, but the run has {num_devices} "
                          f"({jax.process_count()} process(es)); set one axis to -1")
    return shape


def build_mesh(mesh_cfg: MeshSection, model: ModelConfig, *, rows: int, devices=None) -> Mesh:
    """The run's mesh over ``devices`` (default: every process's devices), checked against the
    model (``mesh.tensor`` divides the query heads) and the batch (``data * fsdp`` divides
    ``rollout.rows``: each device holds whole problem rows)."""
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp, tensor = mesh_shape(mesh_cfg, len(devices))
    if model.num_heads % tensor:
        raise ConfigError(f"mesh.tensor={tensor} does not divide the model's {model.num_heads} attention heads")
    if rows % (data * fsdp):
        raise ConfigError(f"rollout.rows={rows} is not divisible by mesh.data x mesh.fsdp = {data * fsdp} "
                          "(the rows are split over those axes)")
    return sharding.make_mesh(data, fsdp, tensor, devices=devices)


def describe_devices(mesh: Mesh | None = None) -> str:
    """One line: this process, its host, its devices, and the mesh (logged by every process)."""
    local = jax.local_devices()
    kinds = sorted({d.device_kind for d in local})
    line = (f"process {jax.process_index()}/{jax.process_count()} on {socket.gethostname()}: "
            f"{len(local)} local {'/'.join(kinds)} device(s) [{', '.join(str(d.id) for d in local)}] "
            f"of {jax.device_count()}")
    if mesh is not None:
        line += f"; mesh {dict(mesh.shape)}"
    return line


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulated_devices_env(devices: int | None, base: dict | None = None, **extra: str) -> dict:
    """The environment of a subprocess on the CPU with ``devices`` simulated devices (``None``:
    JAX's default, one): a copy of ``base`` (default ``os.environ``) plus ``extra``, whose
    ``XLA_FLAGS`` keeps every entry but an earlier device count. The count is fixed when JAX
    starts, so multi-device CPU runs (benchmarks, tests) are subprocesses."""
    env = dict(os.environ if base is None else base, JAX_PLATFORMS="cpu", **extra)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != _DEVICE_COUNT_FLAG]
    if devices is not None:
        flags.append(f"{_DEVICE_COUNT_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env
