"""The jitted sampler against HF greedy ``generate`` and against our own uncached forward.

References: HF PyTorch ``generate`` (greedy, left-padded), the argmax / log-softmax of our
uncached full forward (which checks the KV cache and the position bookkeeping), exact
hand-made distributions for the top-p threshold, and per-agent runs for per-row adapters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("transformers")

from marft_jax.models import decoder  # noqa: E402
from marft_jax.models import lora as lora_lib  # noqa: E402
from marft_jax.sampling import buckets  # noqa: E402
from marft_jax.sampling import sampler as smp  # noqa: E402
from tests import hf_tiny  # noqa: E402

PROMPT_LENS = (5, 12, 9, 3)
BUCKET = 16


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pair(request):
    model = hf_tiny.tiny_hf_model(request.param)
    cfg, params = hf_tiny.to_jax(model)
    return request.param, model, cfg, params


@pytest.fixture(scope="module")
def qwen():
    model = hf_tiny.tiny_hf_model("qwen2")
    cfg, params = hf_tiny.to_jax(model)
    return model, cfg, params


def _uncached_logits(cfg, params, prompts, out_tokens, lengths, lora=None, agent=None):
    """Logits predicting each generated token, from one uncached forward over prompt + action.

    Returns ``[batch, max_new, vocab]``: entry k is the distribution that generated token k.
    """
    pb = buckets.pad_prompts(prompts, min_length=BUCKET)
    n, length = len(prompts), pb.tokens.shape[1]
    max_new = out_tokens.shape[1]
    full = np.concatenate([pb.tokens[:n], out_tokens], 1).astype(np.int32)
    valid = np.concatenate([pb.valid[:n], np.arange(max_new)[None] < lengths[:, None]], 1)
    kw = {} if lora is None else dict(lora=lora, agent=jnp.asarray(agent, jnp.int32))
    lg = decoder.logits_fn(params, jnp.asarray(full), jnp.asarray(valid), cfg=cfg, **kw)
    return np.asarray(lg)[:, length - 1: length - 1 + max_new]


def _hf_generate(model, prompts, **kw):
    import torch

    pb = buckets.pad_prompts(prompts, min_length=BUCKET)
    n = len(prompts)
    ids = torch.from_numpy(pb.tokens[:n].astype(np.int64))
    mask = torch.from_numpy(pb.valid[:n].astype(np.int64))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)
    return out[:, pb.tokens.shape[1]:].numpy()


# ----------------------------------------------------------------------------- (a) greedy


def test_greedy_matches_hf_generate_and_uncached_argmax(pair):
    """Greedy 32 tokens == HF greedy generate (left-padded batch) == our uncached argmax.

    Tiny random models have near-ties; these prompts (seed 0) have a top-1 margin of at least
    7e-4 at every step for both archs (asserted below), far above the ~2e-6 logit error.
    """
    _, model, cfg, params = pair
    prompts = _prompts(cfg.vocab_size)
    out = smp.Sampler(cfg, pad_id=0)(params, prompts, key=jax.random.key(0),
                                     config=smp.SamplingConfig(max_new_tokens=32, temperature=0.0))
    assert out.tokens.shape == (4, 32) and out.tokens.dtype == np.int32
    np.testing.assert_array_equal(out.lengths, 32)
    assert not out.finished.any() and out.steps == 32

    lg = _uncached_logits(cfg, params, prompts, out.tokens, out.lengths)
    top2 = np.sort(lg, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-4, "near-tie: pick other prompts"
    np.testing.assert_array_equal(out.tokens, lg.argmax(-1))
    # greedy log-probs are at T = 1
    want = np.take_along_axis(jax.nn.log_softmax(lg, -1), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logps, want, atol=1e-4)

    hf = _hf_generate(model, prompts, max_new_tokens=32, eos_token_id=None)
    np.testing.assert_array_equal(out.tokens, hf)


# ----------------------------------------------------------------------------- (b) keys


def test_same_key_same_samples_different_key_differs(qwen):
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    s = smp.Sampler(cfg)
    conf = smp.SamplingConfig(max_new_tokens=16, temperature=1.0)
    a = s(params, prompts, key=jax.random.key(1), config=conf)
    b = s(params, prompts, key=jax.random.key(1), config=conf)
    c = s(params, prompts, key=jax.random.key(2), config=conf)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logps, b.logps)
    assert (a.tokens != c.tokens).any()


def test_bucketing_does_not_change_samples(qwen):
    """Dummy rows and a longer length bucket leave every real row's sample unchanged."""
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)[:3]
    conf = smp.SamplingConfig(max_new_tokens=16, temperature=1.0)
    key = jax.random.key(3)
    base = smp.Sampler(cfg)(params, prompts, key=key, config=conf)
    wide_sampler = smp.Sampler(cfg, min_prompt_bucket=32, min_batch=8, pad_id=7)
    wide = wide_sampler(params, prompts, key=key, config=conf)
    np.testing.assert_array_equal(base.tokens, wide.tokens)
    np.testing.assert_allclose(base.logps, wide.logps, atol=1e-5)
    # a row's sample does not depend on the rows after it either
    one = smp.Sampler(cfg)(params, prompts[:1], key=key, config=conf)
    np.testing.assert_array_equal(one.tokens[0], base.tokens[0])


def test_changing_sampling_values_does_not_recompile(qwen):
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    s = smp.Sampler(cfg)
    s(params, prompts, key=jax.random.key(0), config=smp.SamplingConfig(max_new_tokens=16, temperature=1.0))
    before = (smp.prefill._cache_size(), smp.decode._cache_size())
    for t, stops in ((0.0, [2]), (0.5, [3, 4, 5]), (1.3, [])):
        s(params, prompts, key=jax.random.key(0), config=smp.SamplingConfig(max_new_tokens=16, temperature=t),
          budget=5, stop_ids=stops)
    assert (smp.prefill._cache_size(), smp.decode._cache_size()) == before


# ----------------------------------------------------------------------------- (c) top-k / top-p


def _allowed(z: np.ndarray, temperature: float, top_k: int, top_p: float, tol: float = 1e-4) -> np.ndarray:
    """Reference support (NumPy): top-k then nucleus of ``softmax(z / T)``, with a tolerance."""
    zt = z.astype(np.float64) / temperature
    allowed = np.ones(z.shape, bool)
    if top_k:
        kth = np.sort(zt)[-top_k]
        allowed &= zt >= kth - tol
        zt = np.where(zt >= kth, zt, -np.inf)
    if top_p < 1.0:
        q = np.exp(zt - zt.max())
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        excl = np.cumsum(q[order]) - q[order]
        keep = np.zeros(z.shape, bool)
        keep[order] = excl < top_p + tol
        allowed &= keep
    return allowed


@settings(max_examples=12, deadline=None)
@given(top_k=st.sampled_from([1, 2, 3, 5, 10]), top_p=st.sampled_from([1.0, 0.05, 0.3, 0.6, 0.9]),
       temperature=st.floats(0.3, 2.0), seed=st.integers(0, 2 ** 16))
def test_top_k_top_p_support(qwen, top_k, top_p, temperature, seed):
    """Every sampled token lies in the top-k set / nucleus computed from the uncached logits.

    (top-k is always on here so the examples share two compiled programs; top-p alone is
    checked exactly in test_top_p_threshold_exact.)
    """
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    conf = smp.SamplingConfig(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p)
    out = smp.Sampler(cfg)(params, prompts, key=jax.random.key(seed), config=conf)
    lg = _uncached_logits(cfg, params, prompts, out.tokens, out.lengths)
    for i in range(len(prompts)):
        for k in range(out.lengths[i]):
            ok = _allowed(lg[i, k], temperature, top_k, top_p)
            assert ok[out.tokens[i, k]], (i, k, top_k, top_p)


def test_top_p_threshold_exact():
    """Hand-made distribution: the nucleus is the smallest prefix whose mass reaches p."""
    probs = jnp.asarray([[0.05, 0.5, 0.15, 0.3]], jnp.float32)
    for p, want in [(0.4, 0.5), (0.5, 0.5), (0.79, 0.3), (0.81, 0.15), (0.96, 0.05), (1.0, 0.05)]:
        tau = float(smp._top_p_threshold(probs, jnp.float32(p))[0, 0])
        assert tau == pytest.approx(want), (p, tau)
    logits = jnp.log(probs)
    kept = smp.filter_logits(logits, smp.SamplingParams.make(1.0, top_k=0, top_p=0.81), use_top_p=True)
    np.testing.assert_array_equal(np.isfinite(np.asarray(kept))[0], [False, True, True, True])
    kept = smp.filter_logits(logits, smp.SamplingParams.make(1.0, top_k=2, top_p=1.0), top_k_max=4)
    np.testing.assert_array_equal(np.isfinite(np.asarray(kept))[0], [False, True, False, True])


def test_inverse_cdf_sampling_frequencies():
    """Empirical frequencies of the one-uniform draw match the distribution (zero mass never drawn)."""
    w = np.array([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0], np.float32)
    n = 40000
    u = 1.0 - jax.random.uniform(jax.random.key(0), (n,))
    idx = np.asarray(smp.inverse_cdf_sample(jnp.broadcast_to(jnp.asarray(w), (n, 7)), u, block=3))
    freq = np.bincount(idx, minlength=7) / n
    np.testing.assert_allclose(freq, w / w.sum(), atol=0.01)
    assert freq[w == 0].sum() == 0
    # u = 1 picks the last non-zero entry, not a padded or zero one
    assert int(smp.inverse_cdf_sample(jnp.asarray(w)[None], jnp.ones(1), block=4)[0]) == 5


# ----------------------------------------------------------------------------- (d) stopping


def test_stop_tokens_end_rows_and_exit_early(qwen):
    model, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    greedy = smp.SamplingConfig(max_new_tokens=16, temperature=0.0)
    free = smp.Sampler(cfg, pad_id=0)(params, prompts, key=jax.random.key(0), config=greedy)
    g = free.tokens

    # one stop id: rows end at its first occurrence (included), the rest are truncated
    stop = int(g[0, 4])
    out = smp.Sampler(cfg, pad_id=0, stop_ids=[stop])(params, prompts, key=jax.random.key(0), config=greedy)
    for i in range(len(prompts)):
        hits = np.nonzero(g[i] == stop)[0]
        want_len = hits[0] + 1 if len(hits) else 16
        assert out.lengths[i] == want_len
        assert out.finished[i] == bool(len(hits))
        np.testing.assert_array_equal(out.tokens[i, :want_len], g[i, :want_len])
        assert (out.tokens[i, want_len:] == 0).all() and (out.logps[i, want_len:] == 0).all()
    assert out.steps == 16 if not out.finished.all() else out.steps == out.lengths.max()
    # HF with the same EOS pads finished rows with pad_token_id: the same arrays
    hf = _hf_generate(model, prompts, max_new_tokens=16, eos_token_id=stop)
    np.testing.assert_array_equal(out.tokens[:, :hf.shape[1]], hf)

    # a stop set hit by every row early: the while_loop exits after the last row stops
    stops = sorted({int(g[i, 2]) for i in range(len(prompts))})
    out = smp.Sampler(cfg, pad_id=0, stop_ids=stops)(params, prompts, key=jax.random.key(0), config=greedy)
    assert out.finished.all() and (out.lengths <= 3).all()
    assert out.steps == out.lengths.max() < 16


def test_budget_truncates(qwen):
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    out = smp.Sampler(cfg, pad_id=9)(params, prompts, key=jax.random.key(0),
                                     config=smp.SamplingConfig(max_new_tokens=16, temperature=1.0), budget=5)
    np.testing.assert_array_equal(out.lengths, 5)
    assert out.steps == 5 and not out.finished.any()
    assert (out.tokens[:, 5:] == 9).all()


def test_low_level_per_row_stop_ids_and_donation(qwen):
    """prefill/decode directly: per-row stop sets [batch, num_stop]; the decode state is donated."""
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    pb = buckets.pad_prompts(prompts, min_length=BUCKET)
    args = lambda stop: (params, None, jnp.asarray(pb.tokens), jnp.asarray(pb.valid), jnp.asarray(pb.active),
                         jnp.int32(0), stop, jax.random.key(0), smp.SamplingParams.make(0.0),
                         jnp.int32(16), jnp.int32(0))
    st0 = smp.prefill(*args(jnp.asarray(smp.stop_id_array([]))), cfg=cfg, max_new_tokens=16)
    g = np.asarray(smp.decode(params, None, st0, cfg=cfg).tokens)
    assert st0.cache.k.is_deleted() and st0.tokens.is_deleted()          # donated, reused in place
    per_row = np.full((4, 8), -1, np.int32)
    per_row[0, 0], per_row[2, 1] = g[0, 3], g[2, 6]
    st = smp.prefill(*args(jnp.asarray(per_row)), cfg=cfg, max_new_tokens=16)
    st = smp.decode(params, None, st, cfg=cfg)
    res = jax.device_get(smp.result_of(st))
    assert res.lengths[0] == np.nonzero(g[0] == g[0, 3])[0][0] + 1 and res.finished[0]
    assert res.lengths[2] == np.nonzero(g[2] == g[2, 6])[0][0] + 1 and res.finished[2]
    assert res.lengths[1] == res.lengths[3] == 16 and not res.finished[[1, 3]].any()


# ----------------------------------------------------------------------------- (e) agents


def test_per_row_agent_equals_separate_agents(qwen):
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    lcfg = lora_lib.LoraConfig(rank=4, targets=("q_proj", "v_proj", "up_proj"))
    stack = lora_lib.init_lora(jax.random.key(5), cfg, lcfg, 3)
    keys = iter(jax.random.split(jax.random.key(6), 8))
    stack = stack.replace(b={t: 0.5 * jax.random.normal(next(keys), v.shape) for t, v in stack.b.items()})
    s = smp.Sampler(cfg)
    conf = smp.SamplingConfig(max_new_tokens=16, temperature=1.0)
    agents = [0, 2, 1, 2]
    mixed = s(params, prompts, key=jax.random.key(7), config=conf, lora=stack, agent=agents)
    each = [s(params, prompts, key=jax.random.key(7), config=conf, lora=stack, agent=a) for a in range(3)]
    for i, a in enumerate(agents):
        np.testing.assert_array_equal(mixed.tokens[i], each[a].tokens[i])
        np.testing.assert_allclose(mixed.logps[i], each[a].logps[i], atol=1e-5)
    assert (each[0].tokens != each[1].tokens).any()                    # the adapters matter
    # and the log-probs are those of the selected adapter's uncached forward
    lg = _uncached_logits(cfg, params, prompts, mixed.tokens, mixed.lengths, lora=stack, agent=agents)
    want = np.take_along_axis(jax.nn.log_softmax(lg, -1), mixed.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(mixed.logps, want, atol=1e-4)


# ----------------------------------------------------------------------------- (f) log-probs


def test_logps_at_sampling_temperature(qwen):
    """logp = log_softmax(z / T)[token] of the uncached forward (top-k not renormalised)."""
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    for conf in (smp.SamplingConfig(max_new_tokens=16, temperature=0.7),
                 smp.SamplingConfig(max_new_tokens=16, temperature=0.7, top_k=5)):
        out = smp.Sampler(cfg, stop_ids=[2])(params, prompts, key=jax.random.key(11), config=conf)
        lg = _uncached_logits(cfg, params, prompts, out.tokens, out.lengths)
        want = np.take_along_axis(jax.nn.log_softmax(lg / 0.7, -1), out.tokens[..., None], -1)[..., 0]
        mask = np.arange(16)[None] < out.lengths[:, None]
        np.testing.assert_allclose(out.logps[mask], want[mask], atol=1e-4)
        assert (out.logps[~mask] == 0).all()


def test_validation_errors():
    with pytest.raises(ValueError, match="temperature"):
        smp.SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        smp.SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        smp.SamplingConfig(max_new_tokens=0)
