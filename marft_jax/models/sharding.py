"""Mesh construction and parameter placement by logical-axis rules.

Every parameter leaf has a tuple of *logical* axis names (one table, :func:`logical_axes`);
:class:`AxisRules` maps logical names to mesh axes (``data`` / ``fsdp`` / ``tensor``). A
mesh axis is never used twice in one spec. A dimension that its mesh axis does not divide (3 kv
heads over 2 tensor shards), or whose axis an earlier dimension already uses, is replicated
instead, never silently: a warning once per parameter says which and why, or, with
``strict=True`` (config ``mesh.strict``), :class:`ShardingRuleError` is raised.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")


class ShardingRuleError(ValueError):
    """A logical-axis rule cannot apply to a parameter (strict mode)."""


_warned: set[str] = set()


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
        if mod in ("q_norm", "k_norm"):          # [layer, head_dim]: per-head weights, replicated
            return ("layer", None)
        out_in = {
            "q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
            "o_proj": ("heads", "embed"), "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
            "down_proj": ("mlp", "embed"),
        }[mod]
        return ("layer",) + (out_in if name == "kernel" else out_in[1:])
    return (None,) * ndim


def to_pspec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules: AxisRules, *,
             name: str | None = None, strict: bool = False) -> P:
    """PartitionSpec for one array. A dimension whose rule cannot apply is replicated with a
    warning (once per ``name``) or, when ``strict``, raises :class:`ShardingRuleError`."""
    used: set[str] = set()
    spec, why = [], []
    for logical_name, dim in zip(logical, shape):
        axis = getattr(rules, logical_name) if logical_name else None
        axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or size == 1:
            spec.append(None)
            continue
        if dim % size or used & set(axes):
            reason = (f"mesh axis {'/'.join(axes)} is already used by another dimension" if used & set(axes)
                      else f"{dim} is not divisible by mesh {'x'.join(axes)}={size}")
            why.append(f"dimension {logical_name!r} ({dim}) replicated: {reason}")
            spec.append(None)
            continue
        used |= set(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    if why:
        label = name or f"array {tuple(shape)}"
        msg = f"sharding rule for {label} cannot apply: " + "; ".join(why)
        if strict:
            raise ShardingRuleError(msg + " (mesh.strict=true)")
        if label not in _warned:
            _warned.add(label)
            warnings.warn(msg, stacklevel=2)
    return P(*spec)


def path_keys(path) -> tuple[str, ...]:
    """A pytree key path (``tree_map_with_path``) as plain names: ``("layers", "q_proj", "kernel")``."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_shardings(params: Any, mesh: Mesh, rules: AxisRules = AxisRules(), *, strict: bool = False) -> Any:
    """NamedSharding for every leaf of a decoder parameter pytree (``strict``: see :func:`to_pspec`)."""
    def one(path, x):
        keys = path_keys(path)
        return NamedSharding(mesh, to_pspec(logical_axes(keys, x.ndim), x.shape, mesh, rules,
                                            name="/".join(keys), strict=strict))
    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params: Any, mesh: Mesh, rules: AxisRules = AxisRules(), *, strict: bool = False) -> Any:
    """Place parameters on ``mesh`` according to ``rules``."""
    return jax.device_put(params, param_shardings(params, mesh, rules, strict=strict))


def batch_sharding(mesh: Mesh, ndim: int, rules: AxisRules = AxisRules(), batch_axis: int = 0) -> NamedSharding:
    """Shard axis ``batch_axis`` of an ``ndim``-array over the batch mesh axes."""
    spec = [None] * ndim
    axes = (rules.batch,) if isinstance(rules.batch, str) else tuple(rules.batch)
    spec[batch_axis] = axes if len(axes) > 1 else axes[0]
    return NamedSharding(mesh, P(*spec))


def constrain_rows(x: jax.Array, axis: int = 0, rules: AxisRules = AxisRules(), *,
                   keep_other_axes: bool = False) -> jax.Array:
    """Inside a ``jax.set_mesh`` context: ask XLA to keep ``x`` split over the batch mesh axes on
    ``axis`` (where an index or gather would otherwise leave it replicated on every device).
    The other dimensions are replicated, or with ``keep_other_axes`` left to XLA (a KV cache
    keeps its kv heads split over ``tensor``). A no-op without a context mesh, or where the axes
    do not divide the dimension."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    wanted = (rules.batch,) if isinstance(rules.batch, str) else tuple(rules.batch)
    axes = tuple(a for a in wanted if a in mesh.axis_names and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if size == 1 or x.shape[axis] % size:
        return x
    spec = [P.UNCONSTRAINED if keep_other_axes else None] * x.ndim
    spec[axis] = axes if len(axes) > 1 else axes[0]
    return jax.lax.with_sharding_constraint(x, P(*spec))


def put(x, target: NamedSharding) -> jax.Array:
    """``x`` (host or device array) as a global array with sharding ``target``: on one process
    or many (every process holds ``x`` whole and materialises only its own devices' blocks)."""
    if isinstance(x, jax.Array):
        if x.is_fully_addressable and jax.process_count() == 1:
            return jax.device_put(x, target)
        return jax.jit(lambda a: a, out_shardings=target)(x)      # a global array: reshard in place
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


def to_host(tree: Any) -> Any:
    """Every leaf of ``tree`` as a whole NumPy array on this host. A leaf split over devices of
    other processes is gathered from them (``process_allgather``: every process must call this
    together); a local or fully replicated leaf is read directly."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, tree)
