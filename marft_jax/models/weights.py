"""Hugging Face checkpoints -> decoder parameter pytrees.

``load_hf_checkpoint(dir)`` reads ``config.json`` and ``*.safetensors`` (one file, or shards
listed by ``model.safetensors.index.json``) and returns ``(ModelConfig, params)``. The mapping
from HF tensor names is one table (:func:`hf_key_map`); missing tensors, shape mismatches and
unknown keys raise :class:`CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from flax import traverse_util

from marft_jax.models.config import ModelConfig
from marft_jax.models.safetensors_mmap import SafetensorsError, SafetensorsFile

_LAYER_KEYS = {
    "input_layernorm.weight": ("input_norm",),
    "post_attention_layernorm.weight": ("post_norm",),
    "self_attn.q_proj.weight": ("q_proj", "kernel"), "self_attn.q_proj.bias": ("q_proj", "bias"),
    "self_attn.k_proj.weight": ("k_proj", "kernel"), "self_attn.k_proj.bias": ("k_proj", "bias"),
    "self_attn.v_proj.weight": ("v_proj", "kernel"), "self_attn.v_proj.bias": ("v_proj", "bias"),
    "self_attn.o_proj.weight": ("o_proj", "kernel"), "self_attn.o_proj.bias": ("o_proj", "bias"),
    "self_attn.q_norm.weight": ("q_norm",), "self_attn.k_norm.weight": ("k_norm",),
    "mlp.gate_proj.weight": ("gate_proj", "kernel"), "mlp.up_proj.weight": ("up_proj", "kernel"),
    "mlp.down_proj.weight": ("down_proj", "kernel"),
}
# HF keys that carry no parameters of ours and may be ignored.
_IGNORABLE = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


class CheckpointError(ValueError):
    """A checkpoint does not match the model config (names the tensor and the file)."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape ([out, in] for linear weights) for every tensor we need."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.q_size, h), "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h), "self_attn.o_proj.weight": (h, cfg.q_size),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    if cfg.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (cfg.q_size,), "self_attn.k_proj.bias": (cfg.kv_size,),
                          "self_attn.v_proj.bias": (cfg.kv_size,)})
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,)})
    for i in range(cfg.num_layers):
        for k, s in per_layer.items():
            shapes[f"model.layers.{i}.{k}"] = s
    return shapes


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """Where one leaf of our pytree comes from: HF tensor ``names`` (one per layer when
    ``stacked``), transposed from HF's ``[out, in]`` to our ``[in, out]`` when ``transpose``."""

    names: tuple[str, ...]
    stacked: bool = False
    transpose: bool = False

    def read(self, get: Callable[[str], np.ndarray], index: tuple | None, dtype) -> np.ndarray:
        """The leaf, or its block ``index`` (slices in our layout), as a ``dtype`` array; only
        that block is read where ``get`` returns lazy (memory-mapped) arrays."""
        def one(name: str, idx: tuple | None) -> np.ndarray:
            arr = get(name)
            block = arr if idx is None else arr[idx[::-1] if self.transpose else idx]
            return np.asarray(block).T if self.transpose else np.asarray(block)

        if self.stacked:
            layers = self.names if index is None else self.names[index[0]]
            rest = None if index is None else tuple(index[1:])
            return np.stack([one(n, rest) for n in layers]).astype(dtype, copy=False)
        return np.array(one(self.names[0], None if index is None else tuple(index)), dtype=dtype, order="C")


def leaf_sources(cfg: ModelConfig) -> dict[tuple[str, ...], _Leaf]:
    """Our parameter path (keys into the decoder pytree) -> the HF tensors it is made of."""
    want = expected_shapes(cfg)
    leaves = {("embed",): _Leaf(("model.embed_tokens.weight",)), ("final_norm",): _Leaf(("model.norm.weight",))}
    if not cfg.tie_word_embeddings:
        leaves[("lm_head",)] = _Leaf(("lm_head.weight",), transpose=True)
    for suffix, path in _LAYER_KEYS.items():
        if f"model.layers.0.{suffix}" in want:
            leaves[("layers", *path)] = _Leaf(tuple(f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)),
                                              stacked=True, transpose=path[-1] == "kernel")
    return leaves


def leaf_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Our parameter path -> its shape (layers stacked first, kernels ``[in, out]``)."""
    want = expected_shapes(cfg)
    out = {}
    for path, leaf in leaf_sources(cfg).items():
        shape = want[leaf.names[0]][::-1] if leaf.transpose else want[leaf.names[0]]
        out[path] = ((len(leaf.names),) if leaf.stacked else ()) + tuple(shape)
    return out


def check_tensors(cfg: ModelConfig, present: list[str], source: str,
                  shape_of: Callable[[str], tuple[int, ...]] | None = None) -> None:
    """Raise :class:`CheckpointError` for an unknown or missing tensor, or (with ``shape_of``)
    one of the wrong shape, naming it and ``source``."""
    want = expected_shapes(cfg)
    unknown = [n for n in present if n not in want and not _IGNORABLE.search(n)
               and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unknown:
        raise CheckpointError(f"{source}: unknown tensor(s) {unknown[:5]}"
                              f"{' …' if len(unknown) > 5 else ''} for a {cfg.arch} model")
    missing = [n for n in want if n not in set(present)]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    for name in want if shape_of is not None else ():
        _check_shape(name, tuple(shape_of(name)), want[name], source)


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...], source: str) -> None:
    if got != want:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {got}, expected {want} for this config")


def params_from_state_dict(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
    names: list[str] | None = None,
    source: str = "checkpoint",
    dtype=np.float32,
) -> dict:
    """Build the decoder pytree from HF-named tensors.

    Args:
      cfg: the model config the tensors must match.
      tensors: a mapping name -> array, or a loader ``name -> array`` (lazy, for big files).
      names: every tensor name present (needed with a loader; defaults to the mapping's keys).
      source: what to call the origin in error messages (a file or directory path).
      dtype: numpy dtype of the returned leaves.
    Raises:
      CheckpointError: a tensor is missing, has the wrong shape, or is unknown.
    """
    get = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
    check_tensors(cfg, list(tensors.keys()) if names is None else list(names), source)
    want = expected_shapes(cfg)

    def checked(name: str) -> np.ndarray:
        arr = get(name)
        _check_shape(name, tuple(np.shape(arr)), want[name], source)
        return arr

    return traverse_util.unflatten_dict({path: leaf.read(checked, None, dtype) for path, leaf in leaf_sources(cfg).items()})


ShardingsFn = Callable[[ModelConfig, dict], Any]


def load_hf_checkpoint(path: str | Path, dtype=np.float32, place: ShardingsFn | None = None) -> tuple[ModelConfig, dict]:
    """Load ``config.json`` + safetensors from an HF model directory.

    Returns ``(ModelConfig, params)``. Without ``place`` the leaves are whole NumPy arrays of
    ``dtype``. With ``place`` (``(cfg, pytree of jax.ShapeDtypeStruct) -> pytree of
    Sharding``) they are global ``jax.Array``s born sharded: each leaf is built by
    :func:`jax.make_array_from_callback`, which asks for the blocks of this process's devices
    only, and each block is read from the memory-mapped file alone, so no process holds the
    whole model on the host (a replicated leaf is read whole by every process).

    Tensors may be stored in any float dtype, bfloat16 included (``safetensors_mmap``).
    """
    import jax

    from marft_jax.models import sharding

    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"model path {str(root)!r} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"model path {str(root)!r} is not a directory (expected an HF model folder)")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{root}: no config.json")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from e
    cfg = ModelConfig.from_hf(hf_cfg)

    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors files")
        weight_map = {}
    handles: dict[str, SafetensorsFile] = {}
    for f in files:
        fp = root / f
        if not fp.is_file():
            raise CheckpointError(f"{index}: shard {f!r} is listed but missing")
        try:
            handles[f] = SafetensorsFile(fp)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        if not index.is_file():
            for k in handles[f].keys():
                weight_map[k] = f
    for name, f in weight_map.items():
        if name not in handles[f].keys():
            raise CheckpointError(f"{index}: tensor {name!r} is listed in {f!r} but not stored there")
    get = lambda n: handles[weight_map[n]].array(n)
    if place is None:
        return cfg, params_from_state_dict(cfg, get, names=list(weight_map), source=str(root), dtype=dtype)

    check_tensors(cfg, list(weight_map), str(root), shape_of=lambda n: handles[weight_map[n]].shape(n))
    shapes = leaf_shapes(cfg)
    abstract = traverse_util.unflatten_dict({p: jax.ShapeDtypeStruct(s, dtype) for p, s in shapes.items()})
    shardings = place(cfg, abstract)
    sources = leaf_sources(cfg)

    def born(path, target):
        keys = sharding.path_keys(path)
        leaf, blocks = sources[keys], {}

        def block(idx):    # devices holding the same block (replicas) share one read
            key = tuple((sl.start, sl.stop, sl.step) for sl in idx)
            if key not in blocks:
                blocks[key] = leaf.read(get, idx, dtype)
            return blocks[key]
        return jax.make_array_from_callback(shapes[keys], target, block)

    return cfg, jax.tree_util.tree_map_with_path(born, shardings)
