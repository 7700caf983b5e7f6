"""Mesh construction and parameter placement by logical-axis rules.

Every parameter leaf has a tuple of *logical* axis names (one table, :func:`logical_axes`);
:class:`AxisRules` maps logical names to mesh axes (``data`` / ``fsdp`` / ``tensor``). A
mesh axis is never used twice in one spec, and a dimension that the mesh axis does not divide
is replicated instead (e.g. 3 kv heads over 2 tensor shards).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from marft_jax.models.config import ModelConfig

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis -> mesh axis (None = replicated)."""

    batch: Any = ("data", "fsdp")
    embed: str | None = "fsdp"
    heads: str | None = "tensor"
    kv_heads: str | None = "tensor"
    mlp: str | None = "tensor"
    vocab: str | None = "tensor"
    layer: str | None = None
    agent: str | None = None
    rank: str | None = None


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh; ``data=-1`` takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    if data == -1:
        if len(devices) % (fsdp * tensor):
            raise ValueError(f"{len(devices)} devices are not divisible by fsdp*tensor={fsdp * tensor}")
        data = len(devices) // (fsdp * tensor)
    if data * fsdp * tensor != len(devices):
        raise ValueError(f"mesh data={data} fsdp={fsdp} tensor={tensor} needs "
                         f"{data * fsdp * tensor} devices, have {len(devices)}")
    return Mesh(np.array(devices).reshape(data, fsdp, tensor), MESH_AXES)


def logical_axes(path: tuple[str, ...], ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at ``path`` (keys into the decoder / LoRA pytree)."""
    name = path[-1]
    if path[0] == "embed":
        return ("vocab", "embed")
    if path[0] == "lm_head":
        return ("embed", "vocab")
    if path[0] == "final_norm":
        return ("embed",)
    if path[0] == "layers":
        mod = path[1]
        if mod in ("input_norm", "post_norm"):
            return ("layer", "embed")
        out_in = {
            "q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
            "o_proj": ("heads", "embed"), "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
            "down_proj": ("mlp", "embed"),
        }[mod]
        return ("layer",) + (out_in if name == "kernel" else out_in[1:])
    return (None,) * ndim


def to_pspec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules: AxisRules) -> P:
    """PartitionSpec for one array; replicates dims a mesh axis does not divide."""
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical, shape):
        axis = getattr(rules, name) if name else None
        axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or size == 1 or dim % size or used & set(axes):
            spec.append(None)
            continue
        used |= set(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def param_shardings(params: Any, mesh: Mesh, rules: AxisRules = AxisRules()) -> Any:
    """NamedSharding for every leaf of a decoder parameter pytree."""
    def one(path, x):
        keys = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)
        return NamedSharding(mesh, to_pspec(logical_axes(keys, x.ndim), x.shape, mesh, rules))
    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params: Any, mesh: Mesh, rules: AxisRules = AxisRules()) -> Any:
    """Place parameters on ``mesh`` according to ``rules``."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int, rules: AxisRules = AxisRules(), batch_axis: int = 0) -> NamedSharding:
    """Shard axis ``batch_axis`` of an ``ndim``-array over the batch mesh axes."""
    spec = [None] * ndim
    axes = (rules.batch,) if isinstance(rules.batch, str) else tuple(rules.batch)
    spec[batch_axis] = axes if len(axes) > 1 else axes[0]
    return NamedSharding(mesh, P(*spec))


def check_config_fits(cfg: ModelConfig, mesh: Mesh) -> None:
    """Raise if the tensor axis cannot split the query heads (kv heads may be replicated)."""
    t = mesh.shape["tensor"]
    if cfg.num_heads % t:
        raise ValueError(f"mesh tensor={t} does not divide num_attention_heads={cfg.num_heads}")
