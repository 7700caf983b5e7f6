"""Length / batch buckets and left padding (hypothesis properties; padding never changes outputs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marft_jax.models import decoder
from marft_jax.models.config import ModelConfig
from marft_jax.sampling import buckets


@given(n=st.integers(0, 5000), minimum=st.sampled_from([1, 8, 16, 64]))
def test_length_bucket_covers_and_is_pow2(n, minimum):
    b = buckets.length_bucket(n, minimum=minimum)
    assert b >= n and b >= minimum
    assert b & (b - 1) == 0                      # a power of two
    assert b == minimum or b < 2 * max(n, 1)     # the smallest such power


@given(n=st.integers(0, 300), cap=st.integers(1, 300))
def test_length_bucket_cap(n, cap):
    if n > cap:
        with pytest.raises(ValueError, match="exceeds"):
            buckets.length_bucket(n, minimum=16, maximum=cap)
    else:
        b = buckets.length_bucket(n, minimum=16, maximum=cap)
        assert n <= b <= cap


def test_bucket_errors():
    with pytest.raises(ValueError):
        buckets.length_bucket(-1)
    with pytest.raises(ValueError):
        buckets.batch_bucket(0)
    with pytest.raises(ValueError, match="empty"):
        buckets.pad_prompts([[1, 2], []])
    with pytest.raises(ValueError, match="at least one"):
        buckets.pad_prompts([])


lens_st = st.lists(st.integers(1, 40), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(lens=lens_st, pad_id=st.integers(0, 5), min_batch=st.sampled_from([1, 4, 8]))
def test_pad_prompts_layout(lens, pad_id, min_batch):
    rng = np.random.default_rng(sum(lens))
    seqs = [rng.integers(10, 1000, n).tolist() for n in lens]
    pb = buckets.pad_prompts(seqs, pad_id=pad_id, min_length=16, min_batch=min_batch)
    b, length = pb.tokens.shape
    assert pb.tokens.dtype == np.int32 and pb.valid.dtype == bool
    assert length == buckets.length_bucket(max(lens), minimum=16)
    assert b == buckets.batch_bucket(len(lens), minimum=min_batch) and pb.num_real == len(lens)
    np.testing.assert_array_equal(pb.active, np.arange(b) < len(lens))
    for i, s in enumerate(seqs):
        n = len(s)
        np.testing.assert_array_equal(pb.tokens[i, length - n:], s)            # real tokens at the right
        np.testing.assert_array_equal(pb.valid[i], np.arange(length) >= length - n)
        assert (pb.tokens[i, :length - n] == pad_id).all()
    # dummy rows: inactive, one valid pad token at the end (no empty row for the model)
    for i in range(len(lens), b):
        assert pb.valid[i].sum() == 1 and pb.valid[i, -1]
        assert (pb.tokens[i] == pad_id).all()
    # positions skip the left padding: the real tokens sit at positions 0 .. n-1
    pos = np.asarray(decoder.position_ids(jnp.asarray(pb.valid)))
    for i, n in enumerate(lens):
        np.testing.assert_array_equal(pos[i, length - n:], np.arange(n))


_CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def small_params():
    import jax
    return decoder.init_params(jax.random.key(0), _CFG, std=0.2)


@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=3), pad_id=st.integers(0, 63),
       extra_len=st.sampled_from([16, 32]))
def test_padding_never_changes_outputs(small_params, lens, pad_id, extra_len):
    """Logits at real positions are the same for any pad id, length bucket and batch bucket."""
    rng = np.random.default_rng(len(lens) * 100 + sum(lens))
    seqs = [rng.integers(0, 64, n).tolist() for n in lens]
    ref_tok, ref_valid = buckets.left_pad(seqs, 16, pad_id=0)
    ref = np.asarray(decoder.logits_fn(small_params, jnp.asarray(ref_tok), jnp.asarray(ref_valid), cfg=_CFG))
    pb = buckets.pad_prompts(seqs, pad_id=pad_id, min_length=extra_len, min_batch=4)
    got = np.asarray(decoder.logits_fn(small_params, jnp.asarray(pb.tokens), jnp.asarray(pb.valid), cfg=_CFG))
    length = pb.tokens.shape[1]
    for i, n in enumerate(lens):
        np.testing.assert_allclose(got[i, length - n:], ref[i, 16 - n:], atol=1e-5)
