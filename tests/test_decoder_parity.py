"""Decoder parity with HF PyTorch on tiny random configs (float32, left padding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from marft_jax.models import decoder  # noqa: E402
from marft_jax.models.config import ModelConfig, UnsupportedConfigError  # noqa: E402
from tests import hf_tiny  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pair(request):
    model = hf_tiny.tiny_hf_model(request.param)
    cfg, params = hf_tiny.to_jax(model)
    return request.param, model, cfg, params


def test_config_flags(pair):
    arch, _, cfg, params = pair
    if arch == "qwen2":
        assert cfg.qkv_bias and not cfg.tie_word_embeddings and "lm_head" in params
    else:
        assert cfg.tie_word_embeddings and not cfg.qkv_bias and "lm_head" not in params


def test_full_logits_left_padded(pair):
    _, model, cfg, params = pair
    tokens, valid = hf_tiny.left_padded_batch([12, 5, 9, 1], cfg.vocab_size, 12)
    want = hf_tiny.hf_logits(model, tokens, valid)
    got = np.asarray(decoder.logits_fn(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg))
    err = np.abs(got - want)[valid].max()
    assert err <= 1e-4, err


def test_remat_same_logits(pair):
    _, _, cfg, params = pair
    tokens, valid = hf_tiny.left_padded_batch([7, 3], cfg.vocab_size, 8)
    a = decoder.logits_fn(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg)
    b = decoder.logits_fn(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg, remat=True)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_kv_cached_decode_equals_full_forward(pair):
    """Prefill a left-padded prompt, then feed tokens one at a time through the cache."""
    _, _, cfg, params = pair
    prompt_len, extra = 8, 6
    tokens, valid = hf_tiny.left_padded_batch([8, 4, 6], cfg.vocab_size, prompt_len)
    rng = np.random.default_rng(1)
    cont = rng.integers(3, cfg.vocab_size, (3, extra)).astype(np.int32)
    full_tok = np.concatenate([tokens, cont], 1)
    full_valid = np.concatenate([valid, np.ones_like(cont, bool)], 1)
    want = np.asarray(decoder.logits_fn(params, jnp.asarray(full_tok), jnp.asarray(full_valid), cfg=cfg))

    cache = decoder.KVCache.init(cfg, 3, prompt_len + extra)
    h, cache = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg, cache=cache)
    got = [decoder.logits_from_hidden(params, cfg, h)]
    next_pos = valid.sum(1)
    for j in range(extra):
        h, cache = decoder.forward(params, jnp.asarray(cont[:, j:j + 1]), jnp.ones((3, 1), bool),
                                   cfg=cfg, positions=jnp.asarray(next_pos[:, None] + j), cache=cache)
        got.append(decoder.logits_from_hidden(params, cfg, h))
    got = np.concatenate([np.asarray(g) for g in got], 1)
    np.testing.assert_allclose(got[full_valid], want[full_valid], atol=1e-4)


def test_compile_does_not_grow_with_depth():
    """Layers run under one scan: the lowered program has one loop body, not one per layer."""
    from tests.hf_tiny import tiny_hf_config

    def hlo_size(n):
        cfg = ModelConfig.from_hf(tiny_hf_config("llama", num_hidden_layers=n))
        params = decoder.init_params(jax.random.key(0), cfg)
        tok = jnp.zeros((1, 4), jnp.int32)
        return len(decoder.logits_fn.lower(params, tok, tok > -1, cfg=cfg).as_text())

    assert abs(hlo_size(2) - hlo_size(12)) < 200


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"use_sliding_window": True}, "sliding"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_options_named(change, needle):
    base = hf_tiny.tiny_hf_config("qwen2").to_dict()
    base.update(change)
    with pytest.raises(UnsupportedConfigError, match=needle):
        ModelConfig.from_hf(base)
