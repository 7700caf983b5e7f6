"""Tiny random Hugging Face PyTorch models and their marft_jax twins, built locally."""

from __future__ import annotations

import numpy as np

torch = None


def _torch():
    global torch
    import torch as t
    torch = t
    return t


def tiny_hf_config(arch: str, **over):
    """A 2-layer config: ``qwen2`` has q/k/v bias and an untied head, ``llama`` ties embeddings."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(over)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=False, rope_theta=10000.0, **common)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=True, rope_theta=50000.0, **common)
    raise ValueError(arch)


def tiny_hf_model(arch: str, seed: int = 0, **over):
    """(hf_model in eval mode, float32, random weights incl. biases and norms)."""
    t = _torch()
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch, **over)
    t.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with t.no_grad():  # make norms and biases non-trivial so parity covers them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * t.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * t.randn_like(p))
            else:
                p.copy_(0.08 * t.randn_like(p))
    return model


def to_jax(model):
    """(ModelConfig, params) converted through our HF loader."""
    import jax.numpy as jnp
    import jax

    from marft_jax.models.config import ModelConfig
    from marft_jax.models.weights import params_from_state_dict

    cfg = ModelConfig.from_hf(model.config)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return cfg, jax.tree.map(jnp.asarray, params_from_state_dict(cfg, sd, source="hf-tiny"))


def left_padded_batch(lengths, vocab: int, total: int, seed: int = 0):
    """tokens [B, total] int32 left-padded with 0, valid [B, total] bool."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    tokens = np.zeros((b, total), np.int32)
    valid = np.zeros((b, total), bool)
    for i, n in enumerate(lengths):
        tokens[i, total - n:] = rng.integers(3, vocab, n)
        valid[i, total - n:] = True
    return tokens, valid


def hf_logits(model, tokens, valid):
    """HF logits with explicit position ids (cumsum(mask) - 1, clipped at 0)."""
    t = _torch()
    ids = t.from_numpy(np.asarray(tokens, np.int64))
    mask = t.from_numpy(np.asarray(valid, np.int64))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with t.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.numpy()
