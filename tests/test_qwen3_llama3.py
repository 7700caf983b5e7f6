"""Qwen3 dense and Llama 3.x (``llama3`` rope scaling) against tiny random HF PyTorch twins.

References: transformers' ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` built in the test (float32,
eager attention): logits of left-padded batches (<= 1e-4), the rotary module's ``inv_freq``
buffer, and greedy ``generate`` against our jitted sampler (KV cache + decode). The GGUF files
are written as llama.cpp's ``convert_hf_to_gguf.py`` writes them (``attn_q_norm`` /
``attn_k_norm`` for qwen3, a ``rope_freqs`` tensor of divisors for Llama 3 scaling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from marft_jax.models import decoder, gguf_loader, sharding  # noqa: E402
from marft_jax.models.config import ModelConfig, UnsupportedConfigError  # noqa: E402
from marft_jax.sampling import buckets  # noqa: E402
from marft_jax.sampling import sampler as smp  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_gguf import write_gguf  # noqa: E402

TOL = 1e-4
# original_max_position_embeddings 64 (low/high wavelengths 64 / 16): with theta 5e5 and
# head_dim 16 the 8 frequencies' wavelengths are 6.3, 32, 168, ... so one is kept, one is
# interpolated and six are divided by the factor, and a 40-token sequence feels the change.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(kind: str):
    """``qwen3`` (untied, head_dim 24 != hidden/heads), ``qwen3-tied``, ``llama3`` (scaled RoPE)."""
    from transformers import LlamaConfig, Qwen3Config

    if kind.startswith("qwen3"):
        return Qwen3Config(head_dim=24, tie_word_embeddings=kind == "qwen3-tied",
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **COMMON)
    return LlamaConfig(tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE), **COMMON)


def tiny_model(kind: str, seed: int = 0):
    """A float32 eval-mode HF model with random weights and non-trivial norms (q/k norms included)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=["qwen3", "qwen3-tied", "llama3"])
def pair(request):
    model = tiny_model(request.param)
    cfg, params = hf_tiny.to_jax(model)
    return request.param, model, cfg, params


def test_config_and_parameters(pair):
    kind, model, cfg, params = pair
    tied = kind != "qwen3"
    assert cfg.tie_word_embeddings == tied == ("lm_head" not in params)
    assert not cfg.qkv_bias and not cfg.o_bias
    if kind.startswith("qwen3"):
        assert (cfg.arch, cfg.head_dim, cfg.q_size, cfg.rope_theta, cfg.qk_norm) == ("qwen3", 24, 96, 1e6, True)
        assert params["layers"]["q_norm"].shape == params["layers"]["k_norm"].shape == (2, 24)
        assert cfg.rope_scaling is None
    else:
        assert cfg.arch == "llama" and not cfg.qk_norm and cfg.rope_scaling.rope_type == "llama3"
        ours = cfg.rope_inv_freq()
        theirs = model.model.rotary_emb.inv_freq.numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
        default = 1.0 / (cfg.rope_theta ** (np.arange(0, 16, 2, dtype=np.float32) / 16))
        kept = np.isclose(ours, default, rtol=1e-6)
        divided = np.isclose(ours, default / 8, rtol=1e-6)
        assert kept.sum() == 1 and divided.sum() == 6 and (~kept & ~divided).sum() == 1
    assert cfg.num_params() == sum(p.numel() for n, p in model.named_parameters())
    # every leaf has a logical sharding (q/k norms replicated on head_dim)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        assert len(sharding.logical_axes(sharding.path_keys(path), leaf.ndim)) == leaf.ndim


def test_safetensors_directory_loads_the_same(pair, tmp_path):
    """``save_pretrained`` (config.json + safetensors) read back by our loader, whole and born sharded."""
    from marft_jax.models.weights import load_hf_checkpoint

    _, model, cfg, params = pair
    model.save_pretrained(tmp_path)
    mesh = sharding.make_mesh()
    for place in (None, lambda c, abstract: sharding.param_shardings(abstract, mesh)):
        got_cfg, got = load_hf_checkpoint(tmp_path, place=place)
        assert got_cfg == cfg
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, params)


def test_logits_left_padded(pair):
    _, model, cfg, params = pair
    tokens, valid = hf_tiny.left_padded_batch([40, 23, 7], cfg.vocab_size, 40, seed=3)
    want = hf_tiny.hf_logits(model, tokens, valid)
    got = np.asarray(decoder.logits_fn(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg))
    err = np.abs(got - want)[valid].max()
    assert err <= TOL, err


def test_greedy_sampler_matches_hf_generate(pair):
    """Our jitted sampler (prefill into the KV cache, then cached decode steps) == HF greedy."""
    _, model, cfg, params = pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (30, 11, 19)]
    out = smp.Sampler(cfg, pad_id=0)(params, prompts, key=jax.random.key(0),
                                     config=smp.SamplingConfig(max_new_tokens=8, temperature=0.0))
    pb = buckets.pad_prompts(prompts, min_length=16)
    ids = torch.from_numpy(pb.tokens[:3].astype(np.int64))
    mask = torch.from_numpy(pb.valid[:3].astype(np.int64))
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                            eos_token_id=None, max_new_tokens=8)[:, ids.shape[1]:].numpy()
    np.testing.assert_array_equal(out.tokens, hf)


# ------------------------------------------------------------------------------- configs


QWEN3_1_7B = {  # Qwen/Qwen3-1.7B config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA_3_2_1B = {  # meta-llama/Llama-3.2-1B-Instruct config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}


def test_hub_config_files():
    """The config.json of the Hub checkpoints (older ``rope_scaling`` spelling) and their sizes."""
    from transformers import LlamaConfig, Qwen3Config

    q = ModelConfig.from_hf(QWEN3_1_7B)
    assert (q.arch, q.head_dim, q.q_size, q.hidden_size, q.rope_theta, q.tie_word_embeddings) == (
        "qwen3", 128, 2048, 2048, 1e6, True)
    assert q.qk_norm and q.rope_scaling is None and 1.70e9 < q.num_params() < 1.73e9   # "1.7B"
    ll = ModelConfig.from_hf(LLAMA_3_2_1B)
    assert ll.rope_scaling.factor == 32.0 and ll.rope_scaling.original_max_position_embeddings == 8192
    assert ll.eos_token_ids == (128001, 128008, 128009) and 1.23e9 < ll.num_params() < 1.24e9
    # the same through transformers' own parsing (rope_parameters) and its inv_freq
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**{k: v for k, v in LLAMA_3_2_1B.items() if k != "architectures"})
    assert ModelConfig.from_hf(hf) == ll
    np.testing.assert_allclose(ll.rope_inv_freq(), ROPE_INIT_FUNCTIONS["llama3"](hf)[0].numpy(), rtol=1e-6)
    assert ModelConfig.from_hf(Qwen3Config(**{k: v for k, v in QWEN3_1_7B.items() if k != "architectures"})) == q


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     r"rope_scaling\.rope_type 'yarn'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_scaling\.rope_type 'dynamic'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling\.rope_type 'linear'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_refused_options_are_named(change, needle):
    base = dict(QWEN3_1_7B)
    base.update(change)
    with pytest.raises(UnsupportedConfigError, match=needle):
        ModelConfig.from_hf(base)


def test_llama3_scaling_needs_its_fields():
    base = dict(LLAMA_3_2_1B, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="low_freq_factor, high_freq_factor"):
        ModelConfig.from_hf(base)


# ---------------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("kind,arch", [("qwen3", "qwen3"), ("llama3", "llama")])
def test_gguf_matches_hf(kind, arch, tmp_path):
    model = tiny_model(kind, seed=5)
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(path, model, arch)
    names = {t.name for t in gguf_loader.open_gguf(path).tensors}
    assert ("blk.0.attn_q_norm.weight" in names) == (kind == "qwen3") == ("rope_freqs.weight" not in names)
    cfg, params = gguf_loader.load_gguf_checkpoint(path)
    tok = gguf_loader.gguf_tokenizer(path)
    assert tok.decode(tok("hello there,\nthe end!")["input_ids"]) == "hello there,\nthe end!"
    ref, _ = hf_tiny.to_jax(model)
    assert (cfg.arch, cfg.head_dim, cfg.qk_norm, cfg.tie_word_embeddings) == (
        ref.arch, ref.head_dim, ref.qk_norm, ref.tie_word_embeddings)
    if kind == "llama3":
        assert cfg.rope_scaling.rope_type == "freq_factors"
        np.testing.assert_allclose(cfg.rope_inv_freq(), ref.rope_inv_freq(), rtol=1e-6)
    tokens, valid = hf_tiny.left_padded_batch([40, 9], cfg.vocab_size, 40, seed=6)
    got = np.asarray(decoder.logits_fn(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens),
                                       jnp.asarray(valid), cfg=cfg))
    err = np.abs(got - hf_tiny.hf_logits(model, tokens, valid))[valid].max()
    assert err <= TOL, err
