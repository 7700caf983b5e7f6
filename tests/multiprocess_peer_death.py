"""Two jax.distributed processes; process 1 dies after start-up, process 0 waits on a
collective with it. Process 0 must exit with an error within the heartbeat timeout.

Usage: ``python -m tests.multiprocess_peer_death PROCESS_ID PORT`` (run by tests/test_multidevice.py).
"""

from __future__ import annotations

import os
import sys
import time

from marft_jax import distributed
from marft_jax.config import DistSection

proc, port = int(sys.argv[1]), sys.argv[2]
distributed.initialize(DistSection(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=proc,
                                   timeout_s=60, heartbeat_timeout_s=5))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

multihost_utils.sync_global_devices("started")
print(f"process {proc} started", flush=True)
if proc == 1:
    os._exit(0)          # dies without shutting the distributed runtime down
time.sleep(1.0)
for _ in range(1000):    # collectives with a dead peer: must fail, not hang
    multihost_utils.process_allgather(jnp.ones(4))
    time.sleep(0.1)
print("process 0 never noticed", flush=True)
