"""Where each array of a run lives on the mesh (docs/many_devices.md has the table). A run on
one device has a 1-device mesh (:meth:`Placement.single`): it goes through the same code.

* Base weights: by the logical-axis rules (:mod:`marft_jax.models.sharding`): ``fsdp`` on the
  embedding dimension, ``tensor`` on heads / MLP / vocabulary.
* LoRA stack, critic (head and optional LoRA), optimizer states, RNG: replicated. They are a
  few MB; replicating them keeps every agent's update a local computation whose gradients XLA
  all-reduces.
* Every row-indexed array (sampler prompts and KV cache, trajectories, the update batch,
  packed rows): split over the batch mesh axes (``data`` x ``fsdp``) on its row axis, when the
  axis divides; otherwise replicated (correct, only not split).

Arrays are built with :func:`jax.make_array_from_callback` from host arrays that every process
holds whole, so the same code runs on one process or many (each process then materialises only
its own devices' shards).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from marft_jax.models import sharding
from marft_jax.models.sharding import put as _put


@dataclasses.dataclass(frozen=True)
class Placement:
    """The run's mesh and rules, and how to put arrays on it."""

    mesh: Mesh
    rules: sharding.AxisRules = sharding.AxisRules()
    strict: bool = False

    @classmethod
    def single(cls, device: jax.Device | None = None, *, strict: bool = False) -> "Placement":
        """``device`` (default: this process's first) as a ``(1, 1, 1)`` mesh."""
        device = jax.local_devices()[0] if device is None else device
        return cls(sharding.make_mesh(1, 1, 1, devices=[device]), strict=strict)

    @property
    def row_shards(self) -> int:
        """Devices a row axis is split over (``data`` x ``fsdp``)."""
        axes = (self.rules.batch,) if isinstance(self.rules.batch, str) else tuple(self.rules.batch)
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def row_sharding(self, ndim: int, axis: int) -> NamedSharding:
        return sharding.batch_sharding(self.mesh, ndim, self.rules, batch_axis=axis)

    def base_shardings(self, params: Any) -> Any:
        """The base weights' shardings by the rules (``params``: arrays or ShapeDtypeStructs;
        warns, or raises when strict, where a rule cannot apply)."""
        return sharding.param_shardings(params, self.mesh, self.rules, strict=self.strict)

    def base(self, params: Any) -> Any:
        """Base weights placed by the rules (:meth:`base_shardings`)."""
        return jax.tree.map(_put, params, self.base_shardings(params))

    def replicate(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: _put(x, self.replicated), tree)

    def rows(self, x, axis: int = 0):
        """``x`` split over the row shards on ``axis`` (replicated when they do not divide it)."""
        if x is None:
            return None
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim <= axis or x.shape[axis] % self.row_shards:
            return _put(x, self.replicated)
        return _put(x, self.row_sharding(x.ndim, axis))

    def tree_rows(self, tree: Any, axis: int) -> Any:
        """Every leaf of ``tree`` by :meth:`rows` on ``axis``."""
        return jax.tree.map(lambda x: self.rows(x, axis), tree)
