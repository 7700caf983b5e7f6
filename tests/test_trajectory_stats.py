"""Trajectory-level tests of the sampler (:mod:`marft_jax.bench.trajectory_stats`).

Our sampler's finished samples, with rows of different prompt lengths that stop at different
steps (compaction and phase changes included), against the exact per-step distribution from a
teacher-forced uncached forward: the stop martingale, the randomized-PIT KS test and the PIT's
lag-1 correlation all hold. The same tests reject a sampler at the wrong temperature and one
that reuses a draw across steps (each marginal right, the trajectory wrong).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.bench import trajectory_stats as stats
from marft_jax.models import decoder
from marft_jax.models.config import ModelConfig
from marft_jax.sampling import sampler as smp

CFG = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
STOPS = (3, 5)
T, TOP_K, NEW = 0.7, 20, 24


def test_step_distribution_applies_temperature_top_k_and_top_p():
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125]]))
    np.testing.assert_allclose(stats.step_distribution(logits, 1.0), [[0.5, 0.25, 0.125, 0.125]])
    np.testing.assert_allclose(stats.step_distribution(logits, 1.0, top_k=2), [[2 / 3, 1 / 3, 0, 0]])
    np.testing.assert_allclose(stats.step_distribution(logits, 1.0, top_p=0.7), [[2 / 3, 1 / 3, 0, 0]])
    p = stats.step_distribution(logits, 0.5)
    np.testing.assert_allclose(p, np.array([[0.25, 0.0625, 0.015625, 0.015625]]) / 0.34375)


def _sample(params, temperature: float, rows: int = 192, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(6, CFG.vocab_size, rng.integers(2, 12))) for _ in range(rows)]
    s = smp.Sampler(CFG, pad_id=0, stop_ids=STOPS)
    g = s(params, prompts, key=jax.random.key(seed), config=smp.SamplingConfig(NEW, temperature, TOP_K))
    return prompts, [list(map(int, g.tokens[r, :g.lengths[r]])) for r in range(rows)]


def _exact(params, prompts, responses, temperature: float):
    fn = jax.jit(lambda p, t, v: decoder.logits_fn(p, t, v, CFG))
    width = max(len(p) for p in prompts) + NEW
    toks = np.zeros((len(prompts), width), np.int32)
    valid = np.zeros_like(toks, bool)
    for r, (p, resp) in enumerate(zip(prompts, responses)):
        toks[r, :len(p) + len(resp)], valid[r, :len(p) + len(resp)] = p + resp, True
    logits = np.asarray(fn(params, jnp.asarray(toks), jnp.asarray(valid)))
    return [stats.step_distribution(logits[r, len(p) - 1:len(p) - 1 + len(resp)], temperature, TOP_K)
            for r, (p, resp) in enumerate(zip(prompts, responses))]


@pytest.fixture(scope="module")
def params():
    # a wide init, so that the distribution is far from uniform and the stops are likely
    return decoder.init_params(jax.random.key(3), CFG, std=0.6)


def test_our_sampler_passes_the_trajectory_tests(params):
    prompts, responses = _sample(params, T)
    finished = sum(1 for r in responses if r and r[-1] in STOPS)
    assert 20 < finished < len(responses) - 20            # rows stopped at different steps and others ran out
    probs = _exact(params, prompts, responses, T)
    mart = stats.stop_martingale(probs, responses, STOPS)
    u = stats.randomized_pit(probs, responses, np.random.default_rng(0))
    ks, lag = stats.ks_uniform(np.concatenate(u)), stats.lag1_correlation(u)
    assert abs(mart["z"]) < 4, mart
    assert ks["p_value"] > 1e-3, ks
    assert abs(lag["z"]) < 4, lag


def test_the_tests_reject_a_sampler_at_the_wrong_temperature(params):
    prompts, responses = _sample(params, 1.0, seed=1)
    probs = _exact(params, prompts, responses, T)          # checked against T = 0.7
    ks = stats.ks_uniform(np.concatenate(stats.randomized_pit(probs, responses, np.random.default_rng(0))))
    assert ks["p_value"] < 1e-6, ks


def test_the_lag_test_rejects_a_draw_reused_across_steps():
    """Each token drawn exactly from its step's distribution, but with one uniform per row for
    all its steps: every marginal is right, consecutive draws are not independent (and the KS
    test, which assumes independent values, is not the one to ask)."""
    rng = np.random.default_rng(0)
    rows, steps, vocab = 300, 20, 7
    probs, tokens = [], []
    for _ in range(rows):
        p = rng.dirichlet(np.ones(vocab), size=steps)
        u = rng.random()
        tokens.append([int(np.searchsorted(np.cumsum(p[t]), u)) for t in range(steps)])
        probs.append(p)
    pit = stats.randomized_pit(probs, tokens, np.random.default_rng(1))
    assert abs(float(np.concatenate(pit).mean()) - 0.5) < 0.05
    assert stats.lag1_correlation(pit)["z"] > 8


def test_stop_martingale_counts():
    probs = [np.array([[0.5, 0.5], [0.25, 0.75]])]
    out = stats.stop_martingale(probs, [[0, 1]], stop_ids=[1])
    assert out["observed"] == 1 and out["expected"] == 1.25 and out["positions"] == 2
    assert out["variance"] == pytest.approx(0.25 + 0.1875)
