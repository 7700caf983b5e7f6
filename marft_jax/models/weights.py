"""Hugging Face checkpoints -> decoder parameter pytrees.

``load_hf_checkpoint(dir)`` reads ``config.json`` and ``*.safetensors`` (one file, or shards
listed by ``model.safetensors.index.json``) and returns ``(ModelConfig, params)``. The mapping
from HF tensor names is one table (:func:`hf_key_map`); missing tensors, shape mismatches and
unknown keys raise :class:`CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from marft_jax.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_KEYS = {
    "input_layernorm.weight": ("input_norm",),
    "post_attention_layernorm.weight": ("post_norm",),
    "self_attn.q_proj.weight": ("q_proj", "kernel"), "self_attn.q_proj.bias": ("q_proj", "bias"),
    "self_attn.k_proj.weight": ("k_proj", "kernel"), "self_attn.k_proj.bias": ("k_proj", "bias"),
    "self_attn.v_proj.weight": ("v_proj", "kernel"), "self_attn.v_proj.bias": ("v_proj", "bias"),
    "self_attn.o_proj.weight": ("o_proj", "kernel"), "self_attn.o_proj.bias": ("o_proj", "bias"),
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
    for i in range(cfg.num_layers):
        for k, s in per_layer.items():
            shapes[f"model.layers.{i}.{k}"] = s
    return shapes


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
    present = list(tensors.keys()) if names is None else list(names)
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

    def load(name: str) -> np.ndarray:
        arr = np.asarray(get(name))
        if tuple(arr.shape) != want[name]:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                  f"expected {want[name]} for this config")
        return arr.astype(dtype)

    n = cfg.num_layers
    layers: dict = {}
    for suffix, path in _LAYER_KEYS.items():
        if f"model.layers.0.{suffix}" not in want:
            continue
        stacked = np.stack([load(f"model.layers.{i}.{suffix}") for i in range(n)])
        if path[-1] == "kernel":
            stacked = np.ascontiguousarray(np.swapaxes(stacked, 1, 2))  # [out, in] -> [in, out]
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = stacked
    params = {"embed": load("model.embed_tokens.weight"), "layers": layers,
              "final_norm": load("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(load("lm_head.weight").T)
    return params


def load_hf_checkpoint(path: str | Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Load ``config.json`` + safetensors from an HF model directory.

    Returns ``(ModelConfig, params)`` with numpy leaves (put them on devices with
    ``jax.device_put`` or ``marft_jax.models.sharding.shard_params``).
    """
    from safetensors import safe_open

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
    handles = {}
    for f in files:
        fp = root / f
        if not fp.is_file():
            raise CheckpointError(f"{index}: shard {f!r} is listed but missing")
        handles[f] = safe_open(str(fp), framework="numpy")
        if not index.is_file():
            for k in handles[f].keys():
                weight_map[k] = f
    return cfg, params_from_state_dict(
        cfg, lambda n: handles[weight_map[n]].get_tensor(n), names=list(weight_map),
        source=str(root), dtype=dtype)
