"""The decode steps' native matvec over a GGUF file's quantized blocks (model.decode_weights).

References: ``gguf.quants.dequantize`` of the same bytes (the kernel, float64 products), the
float parameters :func:`gguf_loader.load_gguf_checkpoint` dequantizes from the same file (the
cached forward's logits, the sampler's tokens and log-probs, within 1e-5), and a full uncached
forward's log-probs of the sampled tokens (``rollout/logp_mismatch``'s definition, <= 1e-5).
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import decoder, gguf_loader, quant_matmul
from marft_jax.models.config import ModelConfig

TOL = 1e-5
FORMATS = ("Q4_0", "Q4_1", "Q8_0")

pytestmark = pytest.mark.skipif(not quant_matmul.status().available,
                                reason=f"native kernel unavailable: {quant_matmul.status().reason}")


def _blocks(rng, layers: int, n: int, k: int, fmt: str) -> np.ndarray:
    """``[layers, n, k/32 * bytes]`` blocks of random weights; one row is tiny so its float16
    scale is subnormal."""
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    out = []
    for _ in range(layers):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        w[0] *= 1e-4
        out.append(gguf.quants.quantize(w, qtype))
    return np.stack(out)


def _dequantized(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, fmt)).astype(np.float64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 33, 64])
def test_kernel_matches_dequantized_blocks(fmt, rows):
    rng = np.random.default_rng(rows)
    k, n = 96, 37                                   # 3 blocks a row; an odd number of rows
    blocks = _blocks(rng, 3, n, k, fmt)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    assert quant_matmul.block_format(k, blocks.shape[2]) == quant_matmul.FORMATS[fmt][0]
    for layer in (0, 2):
        y = np.asarray(jax.jit(quant_matmul.matmul)(jnp.asarray(x), jnp.asarray(blocks), layer))
        ref = x.astype(np.float64) @ _dequantized(blocks[layer], fmt).T
        assert y.shape == (rows, n)
        np.testing.assert_allclose(y, ref, rtol=0, atol=TOL)
        np.testing.assert_allclose(y[:, 0], ref[:, 0], rtol=1e-5, atol=1e-9)   # the subnormal-scale row


def test_kernel_takes_leading_axes_and_many_pieces():
    rng = np.random.default_rng(0)
    blocks = _blocks(rng, 1, 1000, 64, "Q4_1")      # enough rows for every thread to claim pieces
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    y = np.asarray(quant_matmul.matmul(jnp.asarray(x), jnp.asarray(blocks), 0))
    ref = x.astype(np.float64) @ _dequantized(blocks[0], "Q4_1").T
    assert y.shape == (2, 3, 1000)
    np.testing.assert_allclose(y, ref, rtol=0, atol=TOL)


def test_shapes_and_formats_are_checked():
    blocks = jnp.zeros((1, 4, 40), jnp.uint8)       # Q4_1 rows of 64 weights
    with pytest.raises(ValueError, match="at most 64"):
        quant_matmul.matmul(jnp.zeros((65, 64), jnp.float32), blocks, 0)
    with pytest.raises(ValueError, match="at most 64"):
        quant_matmul.matmul(jnp.zeros((2, 64), jnp.bfloat16), blocks, 0)
    with pytest.raises(ValueError, match="not Q4_0, Q4_1 or Q8_0"):
        quant_matmul.matmul(jnp.zeros((2, 64), jnp.float32), jnp.zeros((1, 4, 42), jnp.uint8), 0)
    with pytest.raises(ValueError, match="uint8 blocks"):
        quant_matmul.matmul(jnp.zeros((2, 64), jnp.float32), jnp.zeros((4, 40), jnp.uint8), 0)


def test_resolve_names_the_key():
    assert quant_matmul.resolve("auto", quantized=True, dtype=jnp.float32) == "native"
    assert quant_matmul.resolve("auto", quantized=False, dtype=jnp.float32) == "dequantized"
    assert quant_matmul.resolve("auto", quantized=True, dtype=jnp.bfloat16) == "dequantized"
    assert quant_matmul.resolve("auto", quantized=True, backend="gpu") == "dequantized"
    assert quant_matmul.resolve("dequantized", quantized=True) == "dequantized"
    with pytest.raises(ValueError, match=r"model.decode_weights=native needs a GGUF checkpoint"):
        quant_matmul.resolve("native", quantized=False)
    with pytest.raises(ValueError, match=r"model.decode_weights=native needs float32"):
        quant_matmul.resolve("native", quantized=True, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"model.decode_weights=native runs on one device"):
        quant_matmul.resolve("native", quantized=True, dtype=jnp.float32, devices=4)
    with pytest.raises(ValueError, match=r"--decode-weights='q4' is not one of"):
        quant_matmul.resolve("q4", quantized=True, key="--decode-weights")
    with pytest.raises(ValueError, match="decode_weights must be 'dequantized' or 'native'"):
        ModelConfig(arch="llama", vocab_size=8, hidden_size=32, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, decode_weights="auto")


# --- a quantized GGUF file end to end -------------------------------------------------------

torch = pytest.importorskip("torch")

from marft_jax.models import registry  # noqa: E402
from marft_jax.sampling.sampler import Sampler, SamplingConfig, decode_weight_bytes  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_gguf import write_gguf  # noqa: E402


@pytest.fixture(scope="module", params=[("llama", "Q4_1"), ("qwen2", "Q8_0"), ("llama", "Q4_0")],
                ids=lambda p: "-".join(p))
def quantized_file(request, tmp_path_factory):
    arch, fmt = request.param
    model = hf_tiny.tiny_hf_model(arch, seed=5)
    path = tmp_path_factory.mktemp(f"gguf_{arch}_{fmt}") / f"tiny-{arch}-{fmt}.gguf"
    write_gguf(path, model, arch, quant=getattr(gguf.GGMLQuantizationType, fmt))
    loaded = registry.load_model(path, dtype=jnp.float32)
    return fmt, loaded


def test_blocks_are_the_loaded_weights(quantized_file):
    """Dequantizing the kept blocks gives exactly the float parameters (llama's q/k rows
    un-permuted the same way), and the LM head's blocks the LM head (tied: the embedding)."""
    fmt, m = quantized_file
    q = m.quantized
    assert set(q["layers"]) == set(decoder.PROJECTIONS) and "lm_head" in q
    for name, blocks in q["layers"].items():
        kernel = np.asarray(m.params["layers"][name]["kernel"])           # [L, K, N]
        assert blocks.dtype == np.uint8 and blocks.shape[:2] == (m.cfg.num_layers, kernel.shape[2])
        for layer in range(m.cfg.num_layers):
            np.testing.assert_array_equal(_dequantized(blocks[layer], fmt).astype(np.float32), kernel[layer].T,
                                          err_msg=name)
    head = m.params["embed"] if m.cfg.tie_word_embeddings else m.params["lm_head"].T
    np.testing.assert_array_equal(_dequantized(q["lm_head"], fmt).astype(np.float32), np.asarray(head))


def _native(m):
    cfg = dataclasses.replace(m.cfg, decode_weights="native")
    return cfg, {**m.params, decoder.QUANTIZED: jax.tree.map(jnp.asarray, m.quantized)}


def test_cached_forward_logits_match_dequantized(quantized_file):
    """A prefill then decode steps (batch 4, per-row positions): logits of the native path equal
    the dequantized path's within 1e-5; the decode program reads no float projection kernel."""
    _, m = quantized_file
    cfg_n, params_n = _native(m)
    cfg_d, params_d = m.cfg, m.params
    tokens, valid = hf_tiny.left_padded_batch([7, 4, 6, 2], m.cfg.vocab_size, 8, seed=3)
    b = tokens.shape[0]

    def run(cfg, params):
        cache = decoder.KVCache.init(cfg, b, 16)
        hidden, cache = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg, cache=cache)
        out = [decoder.logits_from_hidden(params, cfg, hidden[:, -1])]
        pos = jnp.asarray(valid.sum(1))[:, None]
        step = jax.jit(lambda p, tok, pos, c: decoder.forward(p, tok, jnp.ones_like(tok, bool), cfg=cfg,
                                                             positions=pos, cache=c))
        tok = jnp.argmax(out[-1], -1)[:, None].astype(jnp.int32)
        for _ in range(4):
            hidden, cache = step(params, tok, pos, cache)
            out.append(decoder.logits_from_hidden(params, cfg, hidden[:, 0]))
            tok, pos = jnp.argmax(out[-1], -1)[:, None].astype(jnp.int32), pos + 1
        return np.stack([np.asarray(o) for o in out])

    native, deq = run(cfg_n, params_n), run(cfg_d, params_d)
    np.testing.assert_allclose(native, deq, rtol=0, atol=TOL)
    hlo = jax.jit(lambda p, c: decoder.forward(p, jnp.zeros((b, 1), jnp.int32), jnp.ones((b, 1), bool), cfg=cfg_n,
                                               positions=jnp.zeros((b, 1), jnp.int32), cache=c)).lower(
        params_n, decoder.KVCache.init(cfg_n, b, 16)).as_text()
    assert hlo.count(quant_matmul.TARGET) == 7          # the scan body's 7 projections (traced once)


def test_sampler_tokens_logps_and_mismatch(quantized_file):
    """The sampler with the blocks: greedy tokens equal the dequantized path's, sampled
    log-probs within 1e-5, and the mean |sampler - full forward| log-prob (the metric
    ``rollout/logp_mismatch``) <= 1e-5."""
    _, m = quantized_file
    cfg_n, _ = _native(m)
    prompts = [[5, 9, 11, 20, 3], [7, 8], [30, 31, 32, 33, 34, 35, 36], [12]]
    deq = Sampler(m.cfg, pad_id=0, stop_ids=())
    nat = Sampler(cfg_n, pad_id=0, stop_ids=(), quantized=m.quantized)
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0)
    a, b = nat(m.params, prompts, key=jax.random.key(0), config=greedy), deq(m.params, prompts,
                                                                               key=jax.random.key(0), config=greedy)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logps, b.logps, rtol=0, atol=TOL)

    hot = SamplingConfig(max_new_tokens=12, temperature=1.0)
    out = nat(m.params, prompts, key=jax.random.key(1), config=hot)
    diffs = []
    for i, p in enumerate(prompts):
        seq = np.asarray(p + out.tokens[i, :out.lengths[i]].tolist(), np.int32)[None]
        logits = np.asarray(decoder.logits_fn(m.params, jnp.asarray(seq), jnp.ones_like(seq, bool), cfg=m.cfg))[0]
        logp = jax.nn.log_softmax(logits, -1)
        full = np.asarray([logp[len(p) - 1 + t, seq[0, len(p) + t]] for t in range(out.lengths[i])])
        diffs.append(np.abs(full - out.policy_logps[i, :out.lengths[i]]))
    assert np.concatenate(diffs).mean() <= TOL


def test_sampler_refuses_native_without_blocks_and_counts_block_bytes(quantized_file):
    _, m = quantized_file
    cfg_n, params_n = _native(m)
    with pytest.raises(ValueError, match="decode_weights is 'native' but no quantized blocks"):
        Sampler(cfg_n, pad_id=0)
    blocks = sum(x.nbytes for x in jax.tree.leaves(m.quantized))
    floats = sum(x.nbytes for x in jax.tree.leaves(m.params))
    kernels = sum(m.params["layers"][n]["kernel"].nbytes for n in decoder.PROJECTIONS)
    head = m.params["embed"] if m.cfg.tie_word_embeddings else m.params["lm_head"]
    assert decode_weight_bytes(params_n, None, cfg_n) == floats - kernels - head.nbytes + blocks
    assert decode_weight_bytes(m.params, None, m.cfg) == floats


def test_float_checkpoint_has_no_blocks(tmp_path):
    model = hf_tiny.tiny_hf_model("llama", seed=4)
    path = tmp_path / "tiny-f32.gguf"
    write_gguf(path, model, "llama")
    assert gguf_loader.quantized_blocks(path) is None
    assert registry.load_model(path).quantized is None
