"""Prompt-prefix K/V reuse across sampler calls equals prefilling every prompt whole."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from marft_jax.config import LoraConfig
from marft_jax.models import cache_attention, decoder, layer_matmul
from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import init_lora
from marft_jax.sampling import prefix_reuse
from marft_jax.sampling import sampler as smp


def _cfg(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=arch == "qwen2")


@pytest.fixture(scope="module", params=[("qwen2", "xla", "xla"), ("llama", "native", "native")],
                ids=["qwen2-xla", "llama-native-kernels"])
def model(request):
    """A tiny model with two adapters; the second variant reads the reused prefix through the
    native cache-attention kernel (and the native decode matmul for the small calls)."""
    arch, attention, matmul = request.param
    for kernel, used in ((cache_attention, attention), (layer_matmul, matmul)):
        if used == "native" and not kernel.status().available:     # the check also registers it
            pytest.skip(f"native kernel unavailable: {kernel.status().reason}")
    cfg = dataclasses.replace(_cfg(arch), decode_attention=attention, decode_matmul=matmul)
    params = decoder.init_params(jax.random.key(0), cfg, std=0.2)
    lora = init_lora(jax.random.key(1), cfg, LoraConfig(rank=4), 2)
    keys = iter(jax.random.split(jax.random.key(2), 16))
    lora = lora.replace(b={k: 0.3 * jax.random.normal(next(keys), v.shape) for k, v in lora.b.items()})
    return cfg, params, lora


def _tokens(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def _steps(vocab: int) -> list[list[list[int]]]:
    """Three calls' prompts of 3 rows (agents 0, 1, 0): each step's prompt repeats the previous
    one's beginning (row 0 all of it, row 1 its first 50 tokens; row 2's first token differs at
    step 1, so nothing is reused there, then step 2 repeats step 1's)."""
    rng = np.random.default_rng(0)
    s0 = [_tokens(rng, 40, vocab), _tokens(rng, 55, vocab), _tokens(rng, 47, vocab)]
    s1 = [s0[0] + _tokens(rng, 9, vocab), s0[1][:50] + _tokens(rng, 20, vocab),
          [(s0[2][0] + 1) % vocab] + s0[2][1:] + _tokens(rng, 6, vocab)]
    s2 = [s1[0] + _tokens(rng, 5, vocab), s1[1] + _tokens(rng, 70, vocab), s1[2][:45] + _tokens(rng, 3, vocab)]
    return [s0, s1, s2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reused_prefixes_give_the_whole_prefill_samples(model, temperature):
    """Greedy and sampled tokens are equal and log-probs within 1e-5 of a sampler without the
    store, call after call (step 2 reuses K/V that step 1 itself partly reused); the store
    reuses exactly the common prefixes (at least ``min_tokens``) and the prefill computes fewer
    slots."""
    cfg, params, lora = model
    conf = smp.SamplingConfig(max_new_tokens=12, temperature=temperature)
    agents = [0, 1, 0]
    store = prefix_reuse.PrefixStore()
    reusing, whole = smp.Sampler(cfg, pad_id=0), smp.Sampler(cfg, pad_id=0)
    expected_reuse = [0, 40 + 50, 49 + 70 + 45]
    for step, prompts in enumerate(_steps(cfg.vocab_size)):
        key = jax.random.key(10 + step)
        got = reusing(params, prompts, key=key, config=conf, lora=lora, agent=agents, prefix=store)
        want = whole(params, prompts, key=key, config=conf, lora=lora, agent=agents)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        for a, b in ((got.logps, want.logps), (got.policy_logps, want.policy_logps), (got.entropies, want.entropies)):
            np.testing.assert_allclose(a, b, atol=1e-5)
        totals = reusing.take_totals(), whole.take_totals()
        assert totals[0].prefill_reused == expected_reuse[step]
        if step:
            assert totals[0].prefill_slots < totals[1].prefill_slots
    assert store.reused_tokens == sum(expected_reuse)


def test_store_matches_per_agent_and_respects_the_minimum():
    """A row reuses only a stored row of its own agent, at most all but its last token, and
    nothing under ``min_tokens``; another agent set has its own entry."""
    store = prefix_reuse.PrefixStore(min_tokens=4)
    a, b = np.arange(10), np.arange(100, 110)
    stored = prefix_reuse.StoredPrompts(k=None, v=None, tokens=[a, b], agents=np.array([0, 1]))
    store.put([0, 1], stored)
    m = store.match([list(range(10)), list(range(100, 103)) + [7] * 5, list(range(100, 110)) + [1]], [0, 1, 0])
    np.testing.assert_array_equal(m.lengths, [9, 0, 0])     # whole prompt: all but the last token; 3 < 4; agent 0
    assert store.match([list(range(10))], [0]) is None      # the agent set {0} has no entry
    assert prefix_reuse.common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2


def test_reuse_follows_a_retokenized_prefix_only_as_far_as_tokens_agree(model):
    """A later prompt whose tokens differ mid-way (a re-tokenization) reuses only the equal part
    and still samples what a whole prefill samples."""
    cfg, params, lora = model
    rng = np.random.default_rng(3)
    first = _tokens(rng, 64, cfg.vocab_size)
    later = first[:37] + [(first[37] + 1) % cfg.vocab_size] + first[38:] + _tokens(rng, 5, cfg.vocab_size)
    conf = smp.SamplingConfig(max_new_tokens=8, temperature=0.0)
    store = prefix_reuse.PrefixStore()
    s = smp.Sampler(cfg, pad_id=0)
    s(params, [first], key=jax.random.key(0), config=conf, lora=lora, agent=1, prefix=store)
    got = s(params, [later], key=jax.random.key(1), config=conf, lora=lora, agent=1, prefix=store)
    assert s.take_totals().prefill_reused == 37
    want = smp.Sampler(cfg, pad_id=0)(params, [later], key=jax.random.key(1), config=conf, lora=lora, agent=1)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)
