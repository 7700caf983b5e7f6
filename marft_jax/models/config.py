"""Decoder hyper-parameters, read from a Hugging Face ``config.json`` and validated.

Supported: Qwen2 / Qwen2.5 (q/k/v bias, untied head for the larger sizes), Qwen3 dense
(per-head q/k RMSNorm, no biases, ``head_dim`` from the config) and the Llama family (Llama,
Llama 3.x with ``llama3`` rope scaling, SmolLM2: no biases, often tied embeddings). Anything
we do not implement (other rope scaling types, sliding-window attention, other activations or
architectures) raises :class:`UnsupportedConfigError` naming the option, instead of silently
computing the wrong model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("llama3", "freq_factors")   # RopeScaling.rope_type


class UnsupportedConfigError(ValueError):
    """A model config asks for something this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A rescaling of RoPE's inverse frequencies (hashable: part of :class:`ModelConfig`).

    ``llama3`` (Llama 3.1 / 3.2): transformers' ``_compute_llama3_parameters``: frequencies
    whose wavelength exceeds ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``, those below ``original_max_position_embeddings / high_freq_factor`` are kept,
    the band between is interpolated. ``freq_factors``: each inverse frequency divided by its
    entry of ``factors`` (``[head_dim / 2]``; llama.cpp's ``rope_freqs`` tensor in a GGUF file,
    which is how llama.cpp stores the same ``llama3`` scaling).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedConfigError(f"RopeScaling.rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise ValueError("rope_scaling: llama3 needs high_freq_factor != low_freq_factor "
                             f"(both {self.low_freq_factor})")

    def inv_freq(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies, float32 ``[head_dim / 2]`` (radians per position),
        from the default ones ``theta ** (-2i / head_dim)``; float32 throughout, as transformers."""
        f = np.asarray(inv_freq, np.float32)
        if self.rope_type == "freq_factors":
            if len(self.factors) != f.shape[0]:
                raise ValueError(f"rope freq_factors has {len(self.factors)} entries, head_dim/2 is {f.shape[0]}")
            return (f / np.asarray(self.factors, np.float32)).astype(np.float32)
        factor, low, high = (np.float32(v) for v in (self.factor, self.low_freq_factor, self.high_freq_factor))
        old = np.float32(self.original_max_position_embeddings)
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = np.float32(2 * np.pi) / f
        scaled = np.where(wavelen > low_wavelen, f / factor, f)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of one decoder (hashable: used as a jit static argument).

    Attributes:
      arch: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
      vocab_size: rows of the embedding table.
      hidden_size: model width H.
      intermediate_size: SwiGLU width.
      num_layers: decoder blocks (stacked and run with ``lax.scan``).
      num_heads / num_kv_heads: query heads and key/value heads (GQA: heads % kv_heads == 0).
      head_dim: per-head width (RoPE rotates all of it).
      rope_theta: RoPE base frequency.
      rope_scaling: optional rescaling of the RoPE frequencies (:class:`RopeScaling`).
      qk_norm: per-head RMSNorm (weights ``[head_dim]``) on queries and keys before RoPE (Qwen3).
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: the LM head is the transposed embedding table.
      qkv_bias: q/k/v projections carry a bias (Qwen2; Llama with ``attention_bias``).
      o_bias: the output projection carries a bias (Llama with ``attention_bias``).
      max_position_embeddings: longest context the checkpoint was trained for.
      bos_token_id / eos_token_ids: from the config (tokenizers may add more stop tokens).
      attention: the attention implementation of segment attention (training, critic and
        prefill forwards; :mod:`marft_jax.models.attention`).
      decode_matmul: the projections of cached forwards of at most 16 rows (decode steps): ``xla``
        or ``native`` (:mod:`marft_jax.models.layer_matmul`, one CPU device, float32).
      decode_attention: attention over the KV cache (decode and prefills into a filled cache):
        ``xla`` or ``native`` (:mod:`marft_jax.models.cache_attention`, one CPU device, float32).
      causal_attention: under ``attention`` ``xla``, attention within whole rows (training,
        critic and prefill forwards without cached keys): ``xla`` (blocked batched matmuls) or
        ``native`` (:mod:`marft_jax.models.causal_attention`, one CPU device, float32).
      decode_weights: where cached forwards of at most 64 rows and their LM head read the
        weights a GGUF file quantized: ``dequantized`` (the float parameters) or ``native``
        (its Q4_0 / Q4_1 / Q8_0 blocks, :mod:`marft_jax.models.quant_matmul`, one CPU device,
        float32; the blocks come in the params under ``quantized``, which the sampler adds).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention: str = "xla"   # resolved model.attention (marft_jax.models.attention), never "auto"
    decode_attention: str = "xla"   # resolved model.decode_attention: xla | native (models.cache_attention)
    causal_attention: str = "xla"   # resolved model.causal_attention: xla | native (models.causal_attention)
    decode_matmul: str = "xla"      # resolved model.decode_matmul: xla | native (models.layer_matmul)
    decode_weights: str = "dequantized"   # resolved model.decode_weights: dequantized | native (models.quant_matmul)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedConfigError(
                f"model_type {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.decode_attention not in ("xla", "native"):
            raise ValueError(f"ModelConfig.decode_attention must be 'xla' or 'native' (resolved), got {self.decode_attention!r}")
        if self.causal_attention not in ("xla", "native"):
            raise ValueError(f"ModelConfig.causal_attention must be 'xla' or 'native' (resolved), got {self.causal_attention!r}")
        if self.decode_matmul not in ("xla", "native"):
            raise ValueError(f"ModelConfig.decode_matmul must be 'xla' or 'native' (resolved), got {self.decode_matmul!r}")
        if self.decode_weights not in ("dequantized", "native"):
            raise ValueError(f"ModelConfig.decode_weights must be 'dequantized' or 'native' (resolved), "
                             f"got {self.decode_weights!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, float32 ``[head_dim / 2]`` (radians per position)."""
        d = self.head_dim
        inv = (1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
        return inv if self.rope_scaling is None else self.rope_scaling.inv_freq(inv)

    def num_params(self) -> int:
        """Parameter count of the base model (embedding counted once when tied)."""
        h, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + n * layer + h + head

    def flops_per_token(self, context: int = 0) -> float:
        """Forward matmul FLOPs per token (2 per MAC), attention over ``context`` keys included."""
        h, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        proj = h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * f
        attn = 2 * self.q_size * context  # q.k and p.v
        return 2.0 * (n * (proj + attn) + h * self.vocab_size)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Build from a ``transformers`` config object or a ``config.json`` dict.

        Raises :class:`UnsupportedConfigError` naming the option for what we do not implement.
        """
        c: Mapping[str, Any] = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        arch = c.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedConfigError(
                f"model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        if c.get("mlp_bias"):
            raise UnsupportedConfigError("mlp_bias=True is not supported")
        # Qwen2/Qwen3 configs carry a sliding_window size that only use_sliding_window turns on.
        if arch in ("qwen2", "qwen3") and c.get("use_sliding_window"):
            raise UnsupportedConfigError("use_sliding_window=True (sliding-window attention) is not supported")
        if c.get("sliding_window") and arch not in ("qwen2", "qwen3"):
            raise UnsupportedConfigError(f"sliding_window={c['sliding_window']} is not supported")
        if any(t != "full_attention" for t in c.get("layer_types") or ()):
            raise UnsupportedConfigError(f"layer_types {sorted(set(c['layer_types']))} is not supported "
                                         "(only 'full_attention')")
        theta, scaling = _rope(c)
        h = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        eos = c.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(c["vocab_size"]),
            hidden_size=h,
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=arch == "qwen3",
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else attention_bias,   # qwen3, llama: attention_bias
            o_bias=False if arch == "qwen2" else attention_bias,
            max_position_embeddings=int(c.get("max_position_embeddings", 32768)),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope(c: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from transformers 5 ``rope_parameters`` or the older ``rope_scaling``
    + ``rope_theta`` (the latter wins, as in transformers). Only ``default`` and ``llama3`` are
    implemented; any other ``rope_type`` (linear, dynamic, yarn, longrope, ...) is refused."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for source, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if any(isinstance(v, Mapping) for v in d.values()):
            raise UnsupportedConfigError(f"{source} per layer type ({sorted(d)}) is not supported")
        kind = d.get("rope_type", d.get("type", "default")) if d else "default"
        if kind not in ("default", None, "llama3"):
            raise UnsupportedConfigError(
                f"{source}.rope_type {kind!r} is not supported (supported: 'default', 'llama3')")
        partial = d.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedConfigError(f"partial_rotary_factor={partial} (partial RoPE) is not supported")
    d, source = (scaling, "rope_scaling") if scaling else (params, "rope_parameters")
    theta = float(d.get("rope_theta", c.get("rope_theta", params.get("rope_theta", 10000.0))))
    if d.get("rope_type", d.get("type", "default")) != "llama3":
        return theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if d.get(k) is None]
    if missing:
        raise ValueError(f"{source}: rope_type 'llama3' needs {', '.join(missing)}")
    # transformers: a top-level original_max_position_embeddings wins over the dict's, then max positions
    orig = c.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") \
        or c.get("max_position_embeddings")
    if orig is None:
        raise ValueError(f"{source}: rope_type 'llama3' needs original_max_position_embeddings")
    return theta, RopeScaling("llama3", factor=float(d["factor"]), low_freq_factor=float(d["low_freq_factor"]),
                              high_freq_factor=float(d["high_freq_factor"]),
                              original_max_position_embeddings=int(orig))
