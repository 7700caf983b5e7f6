"""The XLA flags of the suite's processes, and the environment of a subprocess with D
simulated CPU devices.

``SUITE_XLA_FLAGS`` is added to ``XLA_FLAGS`` by tests/conftest.py before JAX starts, so the
test workers and every subprocess they start (which inherit ``os.environ``) compile alike:

* ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU emits its fused kernels with the older
  LLVM-IR emitters instead of the MLIR fusion emitters. On the suite's tiny programs compiling
  is most of the time, and it is ~2.5x shorter this way (one seeded training iteration of the
  tiny model, 2-core AMD EPYC, -O0: 11.2 s of XLA compilation -> 4.5 s, 27.5 -> 17.3 CPU-s for
  the whole process); the optimised learning tests run as fast. It changes how a kernel is
  generated, not what it computes: every comparison in the suite has both sides in the same
  setting, and the pinned checksums (tests/test_graph_regression.py) hold under it.
"""

from __future__ import annotations

SUITE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def with_suite_flags(flags: str) -> str:
    """``flags`` plus each suite flag whose name it does not already set (a flag given by the
    person running the suite wins)."""
    names = {f.split("=", 1)[0] for f in flags.split()}
    return " ".join([*flags.split(), *(f for f in SUITE_XLA_FLAGS if f.split("=", 1)[0] not in names)])


def device_env(devices: int | None, base: dict | None = None, **extra: str) -> dict:
    """:func:`marft_jax.distributed.simulated_devices_env` with the suite's flags (where ``base``
    lacks them). (Imported here: conftest imports this module before JAX starts.)"""
    from marft_jax.distributed import simulated_devices_env

    env = simulated_devices_env(devices, base, **extra)
    env["XLA_FLAGS"] = with_suite_flags(env["XLA_FLAGS"])
    return env
