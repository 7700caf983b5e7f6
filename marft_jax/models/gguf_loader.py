"""GGUF (llama.cpp) checkpoints -> ModelConfig, decoder parameters and a fast tokenizer.

A GGUF file carries the config, the (often quantized) tensors and the tokenizer as metadata
under llama.cpp's names. This module reads it with the ``gguf`` package, without torch:

* :func:`gguf_hf_config` builds an HF-style ``config.json`` dict from the metadata (it goes
  through :meth:`ModelConfig.from_hf`, so unsupported options are refused the same way);
* :func:`load_gguf_checkpoint` dequantizes every tensor (``gguf.quants.dequantize``: Q4_1,
  Q8_0, F16, F32, ...) to float32, renames it to its HF name, undoes llama.cpp's q/k row
  permutation for the ``llama`` architecture, and feeds
  :func:`marft_jax.models.weights.params_from_state_dict`; a ``rope_freqs`` tensor (how
  llama.cpp stores Llama 3.x ``llama3`` rope scaling: one divisor per frequency) becomes the
  config's :class:`~marft_jax.models.config.RopeScaling` ``freq_factors``;
* :func:`quantized_blocks` keeps the Q4_0 / Q4_1 / Q8_0 blocks as the file holds them (uint8
  rows of blocks) for the decode steps' native matvec (:mod:`marft_jax.models.quant_matmul`);
* :func:`gguf_tokenizer` builds a ``transformers`` fast tokenizer from the vocabulary, merges,
  special ids and chat template stored in the file.

Supported ``general.architecture`` values: ``llama`` (Llama 2/3.x, SmolLM2), ``qwen2`` and
``qwen3`` (dense; ``attn_q_norm`` / ``attn_k_norm`` per-head norms); anything else raises
:class:`UnsupportedConfigError` naming it. Rope scaling stored as metadata
(``{arch}.rope.scaling.type``: linear, yarn) is refused by :meth:`ModelConfig.from_hf`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Union

import numpy as np

from marft_jax.models.config import ModelConfig, RopeScaling, UnsupportedConfigError
from marft_jax.models.weights import CheckpointError, params_from_state_dict

GGUF_ARCHS = ("llama", "qwen2", "qwen3")
ROPE_FREQS = "rope_freqs.weight"   # llama.cpp's per-frequency RoPE divisors (Llama 3.x scaling)

# llama.cpp tensor name -> HF tensor name (per layer: ``blk.N.<key>`` -> ``model.layers.N.<value>``).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# llama.cpp's pre-tokenizer names that transformers' GGUF converter does not know, and the
# split they stand for. "smollm": digits one by one, then GPT-2 byte-level (the SmolLM2
# tokenizer.json: Digits(individual_digits=True) + ByteLevel(use_regex=True)).
_DIGIT_SPLIT_PRE = ("smollm",)

ReaderLike = Union[str, Path, "Any"]


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped; tensors are read lazily)."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist")
    try:
        return GGUFReader(str(p))
    except Exception as e:  # the reader raises bare ValueErrors on a bad magic/version
        raise CheckpointError(f"{p}: not a readable GGUF file ({e})") from e


def _reader(source: ReaderLike):
    return open_gguf(source) if isinstance(source, (str, Path)) else source


def _source_name(reader) -> str:
    """The file behind a reader, for error messages (``GGUFReader.data`` is a numpy memmap)."""
    return str(getattr(getattr(reader, "data", None), "filename", None) or "gguf file")


def read_metadata(reader, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Metadata key -> python value (str, int, float, bool or list). All keys when ``keys`` is None."""
    out = {}
    for k, field in reader.fields.items():
        if keys is not None and k not in keys:
            continue
        out[k] = field.contents()
    return out


def gguf_architecture(reader) -> str:
    """``general.architecture``, refused with :class:`UnsupportedConfigError` unless supported."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise CheckpointError(f"{_source_name(reader)}: no general.architecture in the GGUF metadata")
    arch = field.contents()
    if arch not in GGUF_ARCHS:
        raise UnsupportedConfigError(
            f"{_source_name(reader)}: GGUF general.architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHS)})")
    return arch


def gguf_hf_config(source: ReaderLike) -> dict[str, Any]:
    """An HF-style config dict (``model_type``, ``hidden_size``, ...) from the GGUF metadata.

    A ``rope_freqs`` tensor is not in the dict (it is no HF option): :func:`gguf_model_config`
    adds it to the :class:`ModelConfig`."""
    reader = _reader(source)
    arch = gguf_architecture(reader)
    meta = read_metadata(reader, keys=tuple(k for k in reader.fields if not k.startswith("tokenizer.ggml.")
                                            or k.endswith("_id")))
    name = _source_name(reader)

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"{name}: GGUF metadata {full!r} is missing")
        return meta[full]

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedConfigError(f"{name}: per-layer {arch}.attention.head_count_kv is not supported")
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedConfigError(
            f"{name}: {arch}.attention.value_length {value_dim} != key_length {head_dim}")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedConfigError(
            f"{name}: {arch}.rope.dimension_count {rope_dims} != head_dim {head_dim} (partial RoPE)")
    if "token_embd.weight" not in tensor_names:
        raise CheckpointError(f"{name}: missing tensor 'token_embd.weight'")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(meta.get(f"{arch}.vocab_size", int(embd.shape[-1])))

    cfg: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 32768)),
        "hidden_act": "silu",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling,
                               "factor": meta.get(f"{arch}.rope.scaling.factor")}
    if f"{arch}.attention.sliding_window" in meta:
        cfg["sliding_window"] = int(meta[f"{arch}.attention.sliding_window"])
        if arch == "qwen2":
            cfg["use_sliding_window"] = True
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if "tokenizer.ggml.bos_token_id" in meta:
        cfg["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.eos_token_id" in meta:
        cfg["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    return cfg


def gguf_model_config(source: ReaderLike) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file: :func:`gguf_hf_config` through
    :meth:`ModelConfig.from_hf`, plus the ``rope_freqs`` divisors when the file has them."""
    reader = _reader(source)
    cfg = ModelConfig.from_hf(gguf_hf_config(reader))
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return cfg
    if cfg.rope_scaling is not None:
        raise UnsupportedConfigError(f"{_source_name(reader)}: tensor {ROPE_FREQS!r} together with "
                                     f"rope scaling metadata ({cfg.rope_scaling.rope_type}) is not supported")
    factors = dequantize_tensor(freqs).reshape(-1)
    if factors.shape[0] != cfg.head_dim // 2:
        raise CheckpointError(f"{_source_name(reader)}: tensor {ROPE_FREQS!r} has {factors.shape[0]} entries, "
                              f"expected head_dim/2 = {cfg.head_dim // 2}")
    return dataclasses.replace(cfg, rope_scaling=RopeScaling("freq_factors", factors=tuple(float(f) for f in factors)))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor, or None when we do not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``).

    llama.cpp stores each head's rows interleaved (pairs ``(2i, 2i+1)`` for its GPT-J style
    rotation); HF rotates halves (``rotate_half``). ``w``: ``[n_head * head_dim, ...]`` (a
    weight ``[out, in]`` or a bias ``[out]``) -> the same shape in HF order.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor) -> np.ndarray:
    """One ``ReaderTensor`` -> float32 numpy array in HF/numpy order (``[out, in]`` for weights)."""
    from gguf.quants import dequantize

    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims fastest-first
    w = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(w, np.float32).reshape(shape)


def load_gguf_checkpoint(source: ReaderLike, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Read a GGUF file into ``(ModelConfig, params)`` with numpy leaves of ``dtype``.

    Quantized tensors are dequantized to float32 one at a time, then cast. For the ``llama``
    architecture the q/k projections (weights and biases) are un-permuted back to HF order.
    Raises :class:`UnsupportedConfigError` for an unsupported ``general.architecture`` and
    :class:`CheckpointError` for unknown, missing or misshapen tensors (naming them).
    """
    reader = _reader(source)
    name = _source_name(reader)
    cfg = gguf_model_config(reader)
    by_hf: dict[str, Any] = {}
    unknown = []
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        hf = hf_tensor_name(t.name)
        if hf is None:
            unknown.append(t.name)
        else:
            by_hf[hf] = t
    if unknown:
        raise CheckpointError(f"{name}: unknown GGUF tensor(s) {unknown[:5]}"
                              f"{' …' if len(unknown) > 5 else ''} for a {cfg.arch} model")

    def get(hf_name: str) -> np.ndarray:
        w = dequantize_tensor(by_hf[hf_name])
        if cfg.arch == "llama":
            if ".self_attn.q_proj." in hf_name:
                w = unpermute_rope_rows(w, cfg.num_heads)
            elif ".self_attn.k_proj." in hf_name:
                w = unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    params = params_from_state_dict(cfg, get, names=list(by_hf), source=name, dtype=dtype)
    return cfg, params


QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")       # what the native decode matvec reads
# decoder projection name -> llama.cpp tensor key in a block
_PROJECTION_TENSORS = {"q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
                       "o_proj": "attn_output.weight", "gate_proj": "ffn_gate.weight",
                       "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight"}


def _block_rows(tensor) -> np.ndarray:
    """A quantized ``[out, in]`` weight's raw blocks, ``[out, in/32 * block bytes]`` uint8."""
    rows = int(tensor.shape[1]) if len(tensor.shape) == 2 else 1
    return np.asarray(tensor.data, np.uint8).reshape(rows, -1)


def quantized_blocks(source: ReaderLike, cfg: ModelConfig | None = None) -> dict[str, Any] | None:
    """The file's Q4_0 / Q4_1 / Q8_0 weights as raw blocks, for :mod:`marft_jax.models.quant_matmul`.

    Returns ``{"layers": {projection: [L, N, K/32 * block bytes] uint8}, "lm_head": [vocab,
    H/32 * block bytes] uint8}`` (numpy), each weight row's blocks in a row as the file holds
    them; a projection is present when every layer stores it in one of :data:`QUANT_TYPES`, the
    LM head when ``output.weight`` (or, tied, ``token_embd.weight``) is. ``llama`` q/k rows are
    un-permuted to HF order, as :func:`load_gguf_checkpoint` does. None when nothing qualifies.
    """
    reader = _reader(source)
    cfg = cfg or gguf_model_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def quantized(name: str) -> bool:
        t = tensors.get(name)
        return t is not None and t.tensor_type.name in QUANT_TYPES and len(t.shape) == 2

    layers = {}
    for proj, key in _PROJECTION_TENSORS.items():
        names = [f"blk.{i}.{key}" for i in range(cfg.num_layers)]
        if not all(quantized(n) for n in names) or len({tensors[n].tensor_type for n in names}) != 1:
            continue
        stack = []
        for n in names:
            rows = _block_rows(tensors[n])
            if cfg.arch == "llama" and proj in ("q_proj", "k_proj"):
                rows = unpermute_rope_rows(rows, cfg.num_heads if proj == "q_proj" else cfg.num_kv_heads)
            stack.append(rows)
        layers[proj] = np.stack(stack)
    out: dict[str, Any] = {"layers": layers} if layers else {}
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    if quantized(head):
        out["lm_head"] = _block_rows(tensors[head])
    return out or None


def gguf_tokenizer(source: ReaderLike):
    """A ``transformers`` fast tokenizer built from the GGUF metadata (no torch needed).

    Carries the vocabulary and merges, the control tokens as special tokens, bos/eos/unk/pad,
    ``add_bos_token``/``add_eos_token`` and the chat template stored in the file.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    reader = _reader(source)
    name = _source_name(reader)
    arch = gguf_architecture(reader)
    meta = read_metadata(reader, keys=tuple(k for k in reader.fields if k.startswith("tokenizer.")))
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{name}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    groups = {group: {new: meta[f"tokenizer.{old}"] for old, new in renames.items()
                      if f"tokenizer.{old}" in meta}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok_dict, tok_cfg = groups["tokenizer"], groups["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        tok_cfg.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    tokens = tok_dict["tokens"]
    for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                         ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        idx = tok_dict.get(key)
        if idx is not None and 0 <= int(idx) < len(tokens):
            tok_cfg[special] = tokens[int(idx)]
    try:
        backend, extra = convert_gguf_tokenizer(arch, tok_dict)
    except ValueError as e:
        raise UnsupportedConfigError(f"{name}: {e}") from e
    if tok_dict.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        from tokenizers import pre_tokenizers

        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok_cfg.update(extra)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_cfg)
