"""Shared test fixtures: tiny random HF models built in the test (no network, no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent")
    return SHARED_DATA


# The longest files first (seconds on the 2-core CI box, `--durations`, 2026-12-05). Under
# `--dist loadfile` each file goes whole to the next free worker in collection order, so a long
# file collected last leaves the other worker idle while it runs; started first, the short files
# fill in around it. Files not listed keep their alphabetical order after these.
LONGEST_FIRST = ("test_multidevice.py", "test_trainer.py", "test_update.py", "test_learning_mixture.py",
                 "test_learning.py", "test_memory_plan.py", "test_graph_regression.py",
                 "test_multidevice_split.py", "test_profiling.py", "test_decode_long.py", "test_sampler.py",
                 "test_packing.py", "test_shared_prefixes.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order within a file kept
