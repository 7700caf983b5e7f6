"""Decode phases, batch compaction, the in-place cache and the policy's own log-probs.

References: HF greedy ``generate`` and our uncached forward (phased decode with cache growth),
the same prompt sampled alone (compaction and batch-size independence),
:func:`marft_jax.models.logprobs.action_logprobs` (``policy_logps`` / ``entropies``), the
no-cache forward (prefill ignores the cache's empty slots) and the optimized HLO (no copy of
the cache stack in the decode loop).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from marft_jax.models import decoder, logprobs  # noqa: E402
from marft_jax.models import lora as lora_lib  # noqa: E402
from marft_jax.sampling import buckets  # noqa: E402
from marft_jax.sampling import sampler as smp  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_sampler import BUCKET, _hf_generate, _prompts, _uncached_logits  # noqa: E402


@pytest.fixture(scope="module")
def qwen():
    model = hf_tiny.tiny_hf_model("qwen2")
    cfg, params = hf_tiny.to_jax(model)
    return model, cfg, params


def _stack(cfg, agents: int = 2):
    lcfg = lora_lib.LoraConfig(rank=4, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    stack = lora_lib.init_lora(jax.random.key(5), cfg, lcfg, agents)
    keys = iter(jax.random.split(jax.random.key(6), 8))
    return stack.replace(b={t: 0.5 * jax.random.normal(next(keys), v.shape) for t, v in stack.b.items()})


# ----------------------------------------------------------------------------- buckets / phases


def test_prompt_bucket_is_finer_above_256_and_covers():
    for n in range(1, 3000, 7):
        b = buckets.prompt_bucket(n)
        assert b >= max(n, 16)
        assert b <= buckets.length_bucket(n)
        if n <= 256:
            assert b == buckets.length_bucket(n)
        elif n <= 1024:
            assert b % 128 == 0 and b - n < 128
        else:
            assert (b - n) <= b // 5
    assert buckets.prompt_bucket(830) == 896 and buckets.prompt_bucket(300, maximum=300) == 300
    pb = buckets.pad_prompts([[3] * 830], fine_above=256)
    assert pb.tokens.shape == (1, 896)


def test_decode_phases():
    assert smp.decode_phases(32, 128) == (32, 64, 128)
    assert smp.decode_phases(1024, 128) == (128,)
    assert smp.decode_phases(16, 16) == (16,)
    for length in (16, 100, 512):
        for n in (1, 5, 33, 200, 1000):
            ph = smp.decode_phases(length, n)
            assert ph[-1] == n and list(ph) == sorted(set(ph))


# ----------------------------------------------------------------------------- cache path


def test_prefill_ignores_the_empty_slots(qwen):
    """read_slots=0: the prompt attends over its own keys only, whatever the cache holds."""
    _, cfg, params = qwen
    tokens, valid = hf_tiny.left_padded_batch([8, 5, 2], cfg.vocab_size, 8)
    want, _ = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg)
    junk = decoder.KVCache.init(cfg, 3, 20)
    junk = junk.replace(k=jnp.full_like(junk.k, 3.0), v=jnp.full_like(junk.v, -2.0),
                        valid=jnp.ones_like(junk.valid))
    got, cache = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg, cache=junk,
                                 read_slots=0)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)
    assert int(cache.index) == 8
    np.testing.assert_array_equal(np.asarray(cache.valid[:, :8]), valid)
    assert (np.asarray(cache.k[:, :, :, 8:]) == 3.0).all()                 # untouched slots


def test_decode_hlo_writes_the_cache_once_in_place(qwen):
    """Optimized HLO of decode: no copy of the cache stack, and only the two (k, v)
    dynamic-update-slices of the whole stack, outside the layer loop."""
    _, cfg, params = qwen
    pb = buckets.pad_prompts(_prompts(cfg.vocab_size), min_length=BUCKET)
    st = smp.prefill(params, None, jnp.asarray(pb.tokens), jnp.asarray(pb.valid), jnp.asarray(pb.active),
                     jnp.int32(0), jnp.asarray(smp.stop_id_array([])), jax.random.key(0),
                     smp.SamplingParams.make(1.0), jnp.int32(8), jnp.int32(0), cfg=cfg, max_new_tokens=8)
    txt = smp.decode.lower(params, None, st, jnp.int32(-1), cfg=cfg).compile().as_text()
    stack = "f32[%d,%d,%d,%d,%d]" % st.cache.k.shape
    producers = [line for line in txt.splitlines()
                 if re.match(r"\s*(ROOT )?%\S+ = " + re.escape(stack) + r"\{", line)]
    ops = [re.search(r"\} (\S+?)\(", line).group(1) for line in producers]
    assert "copy" not in ops, ops
    assert ops.count("dynamic-update-slice") == 2, ops                   # k and v, one each
    fusions = [line for line, op in zip(producers, ops) if op == "fusion"]
    assert len(fusions) <= 2 and all("dynamic-update-slice" in f.split("=")[0] for f in fusions), fusions
    others = {op for op in ops} - {"parameter", "get-tuple-element", "bitcast", "fusion", "dynamic-update-slice",
                                   "tuple", "while"}
    assert not others, others


# ----------------------------------------------------------------------------- phases / compaction


def test_greedy_across_phases_matches_hf_and_uncached(qwen):
    """64 greedy tokens from 16-token prompts run in two phases (32 then 64 new slots; the
    cache grows in between) and still equal HF greedy generate and our uncached argmax.

    These prompts (seed 0) have a top-1 margin >= 1e-4 at every step (asserted)."""
    model, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    assert smp.decode_phases(BUCKET, 64) == (32, 64)
    out = smp.Sampler(cfg, pad_id=0)(params, prompts, key=jax.random.key(0),
                                     config=smp.SamplingConfig(max_new_tokens=64, temperature=0.0))
    assert out.steps == 64 and (out.lengths == 64).all()
    lg = _uncached_logits(cfg, params, prompts, out.tokens, out.lengths)
    top2 = np.sort(lg, -1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-4, "near-tie: pick other prompts"
    np.testing.assert_array_equal(out.tokens, lg.argmax(-1))
    np.testing.assert_array_equal(out.tokens, _hf_generate(model, prompts, max_new_tokens=64, eos_token_id=None))


def test_row_does_not_depend_on_batch_or_compaction(qwen):
    """Row 0 sampled alone == row 0 inside a batch of 8 whose other rows stop early and are
    compacted away (8 -> 4 -> 2 rows, across two phases)."""
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size, lens=(5, 12, 9, 3, 7, 11, 4, 6), seed=3)
    conf = smp.SamplingConfig(max_new_tokens=64, temperature=1.0)
    key = jax.random.key(21)
    sampler = smp.Sampler(cfg, pad_id=0, min_compact_batch=2)
    free = sampler(params, prompts, key=key, config=conf)
    stops = sorted({int(free.tokens[i, 2]) for i in range(1, 8)} - set(free.tokens[0].tolist()))
    before = smp.resize._cache_size()
    out = sampler(params, prompts, key=key, config=conf, stop_ids=stops)
    assert (out.lengths[1:] < 32).sum() >= 5 and out.lengths[0] == 64     # most rows stop early
    assert smp.resize._cache_size() > before                               # compaction compiled/ran
    alone = sampler(params, prompts[:1], key=key, config=conf, stop_ids=stops)
    for res in (out, alone):
        np.testing.assert_array_equal(res.tokens[0], free.tokens[0])
        np.testing.assert_allclose(res.logps[0], free.logps[0], atol=1e-5)
        np.testing.assert_allclose(res.policy_logps[0], free.policy_logps[0], atol=1e-5)
    for i in range(1, 8):                                                  # the early rows, cut
        n = out.lengths[i]
        np.testing.assert_array_equal(out.tokens[i, :n], free.tokens[i, :n])
        assert out.finished[i] == (n < 64) and (out.tokens[i, n:] == 0).all()
        assert (out.policy_logps[i, n:] == 0).all() and (out.entropies[i, n:] == 0).all()


# ----------------------------------------------------------------------------- policy log-probs


@pytest.mark.parametrize("temperature,policy_t,top_k", [(0.7, 1.0, 0), (1.0, 0.8, 5), (0.0, 1.0, 0)])
def test_policy_logps_match_action_logprobs(qwen, temperature, policy_t, top_k):
    """policy_logps / entropies == action_logprobs of the same tokens (tiny model with LoRA,
    per-row agents), to float rounding; zero after each row's end."""
    _, cfg, params = qwen
    prompts = _prompts(cfg.vocab_size)
    stack = _stack(cfg)
    agents = [0, 1, 1, 0]
    conf = smp.SamplingConfig(max_new_tokens=24, temperature=temperature, top_k=top_k)
    out = smp.Sampler(cfg, pad_id=0, stop_ids=[2, 7])(params, prompts, key=jax.random.key(4), config=conf,
                                                     lora=stack, agent=agents, policy_temperature=policy_t)
    pb = buckets.pad_prompts(prompts, min_length=BUCKET)
    act_valid = np.arange(24)[None] < out.lengths[:, None]
    want_lp, want_ent = logprobs.action_logprobs(
        params, stack, jnp.asarray(agents, jnp.int32), jnp.asarray(pb.tokens), jnp.asarray(pb.valid),
        jnp.asarray(out.tokens), jnp.asarray(act_valid), jnp.float32(policy_t), cfg=cfg)
    np.testing.assert_allclose(out.policy_logps, np.asarray(want_lp), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out.entropies, np.asarray(want_ent), atol=2e-5, rtol=1e-5)
    assert (out.policy_logps[~act_valid] == 0).all() and (out.entropies[~act_valid] == 0).all()
    assert (out.entropies[act_valid] > 0).all()
    if temperature == policy_t:
        np.testing.assert_allclose(out.logps, out.policy_logps, atol=1e-5)
