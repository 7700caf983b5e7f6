"""Backups, reward placement and layout against NumPy loop oracles and the §6 worked example."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_jax.bench import reference_backups as backups_reference
from marft_jax.rl import backups, layout, native, rewards
from tests.xla_env import device_env

IMPLS = ("scan", "associative", "blocked", "native")
HYP = settings(max_examples=15, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow])
ATOL = 2e-5


@functools.lru_cache(maxsize=None)
def _jitted(fn_name: str, impl: str, reference_semantics: bool | None = None):
    fn = getattr(backups, fn_name)
    kw = {"impl": impl}
    if reference_semantics is not None:
        kw["reference_semantics"] = reference_semantics
    return jax.jit(functools.partial(fn, **kw))


def skip_unless_native():
    st = native.status()
    if not st.available:
        pytest.skip(f"native backup kernel unavailable: {st.reason}")


def run(fn_name, *args, impl="auto", reference_semantics=None, gamma, lam):
    if impl == "native":
        skip_unless_native()
    f = _jitted(fn_name, impl, reference_semantics)
    adv, ret = f(*(jnp.asarray(a) for a in args), gamma=gamma, lam=lam)
    return np.asarray(adv), np.asarray(ret)


# ----------------------------------------------------------------------------------------------
# Worked example of §6 (hand-derived numbers from the reference document).

WE_V = np.array([[0.5, 0.6, 0.4], [0.7, 0.8, 0.0]], np.float32)         # [agent, token]
WE_LEN = np.array([3, 2])
WE_A_TERMINAL = np.array([[0.047644672, 0.0106176, 0.34808], [0.164, 0.2, 0.0]])
WE_R_TERMINAL = np.array([[0.547644672, 0.6106176, 0.74808], [0.864, 1.0, 0.0]])
WE_A_TRUNC = np.array([[0.1927634944, 0.21217152, 0.628016], [0.5528, 0.74, 0.0]])


def _episode(values, lengths, terminal=True):
    n, k = values.shape
    mask = layout.lengths_to_mask(jnp.asarray(lengths), k)[None, None]          # [1, 1, N, K]
    step_mask = jnp.ones((1, 1), bool)
    term = jnp.full((1, 1), terminal)
    trunc = jnp.full((1, 1), not terminal)
    reward = rewards.place_reward(jnp.array([1.0]), mask, step_mask)
    return reward, jnp.asarray(values)[None, None], mask, step_mask, term, trunc


def _worked_batch():
    """Rows: terminal, truncated (V_boot 0.6), 0-token agent inserted, 0-token agent last.

    The two-agent episode is padded to three agents with an empty agent (placement `last`
    moves the reward to agent 1's last token), so one compiled call serves all variants.
    """
    v2 = np.array([[0.5, 0.6, 0.4], [0.7, 0.8, 0.0], [9.0, 9.0, 9.0]], np.float32)
    rows = [(v2, [3, 2, 0], True), (v2, [3, 2, 0], False),
            (v2[[0, 2, 1]], [3, 0, 2], True), (v2, [3, 2, 0], True)]
    parts = [_episode(v, np.array(l), t) for v, l, t in rows]
    r, v, m, sm, term, trunc = (jnp.concatenate([p[j] for p in parts], axis=1) for j in range(6))
    return r, v, m, sm, term, trunc, jnp.full((4,), 0.6)


@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example_token_level(impl):
    r, v, m, sm, term, trunc, v_boot = _worked_batch()
    np.testing.assert_array_equal(np.asarray(r)[0, 0], [[0, 0, 0], [0, 1, 0], [0, 0, 0]])
    adv, ret = run("token_level_gae", r, v, m, sm, term, trunc, v_boot,
                   impl=impl, gamma=0.9, lam=0.8)
    # terminal
    np.testing.assert_allclose(adv[0, 0, :2], WE_A_TERMINAL, atol=1e-6)
    np.testing.assert_allclose(ret[0, 0, :2], WE_R_TERMINAL, atol=1e-6)
    # truncated with V_boot = 0.6
    np.testing.assert_allclose(adv[0, 1, :2], WE_A_TRUNC, atol=1e-6)
    # a 0-token agent inserted between the two leaves the five advantages unchanged
    np.testing.assert_allclose(adv[0, 2, [0, 2]], WE_A_TERMINAL, atol=1e-6)
    np.testing.assert_allclose(adv[0, 3, :2], WE_A_TERMINAL, atol=1e-6)
    for row, empty in ((0, 2), (1, 2), (2, 1), (3, 2)):
        np.testing.assert_array_equal(adv[0, row, empty], 0.0)
        np.testing.assert_array_equal(ret[0, row, empty], 0.0)


@pytest.mark.parametrize("impl", ["scan", "blocked", "native"])
def test_worked_example_action_level(impl):
    v = jnp.array([[[0.5, 0.7], [0.5, 0.7]]])                         # [1, 2 rows, 2 agents]
    dp = jnp.ones((1, 2, 2), bool)
    sm, term, trunc = jnp.ones((1, 2), bool), jnp.ones((1, 2), bool), jnp.zeros((1, 2), bool)
    r_last = rewards.place_reward(jnp.array([1.0, 1.0]), dp, sm, reward_to="last")
    r_all = rewards.place_reward(jnp.array([1.0, 1.0]), dp, sm, reward_to="all")
    np.testing.assert_array_equal(np.asarray(r_last)[0, 0], [0.0, 1.0])
    np.testing.assert_array_equal(np.asarray(r_all)[0, 0], [1.0, 1.0])
    r = jnp.stack([r_last[:, 0], r_all[:, 1]], axis=1)                 # row 0: last, row 1: all
    adv, ret = run("action_level_gae", r, v, dp, sm, term, trunc, jnp.zeros(2),
                   impl=impl, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv[0, 0], [0.346, 0.3], atol=1e-6)
    np.testing.assert_allclose(ret[0, 0], [0.846, 1.0], atol=1e-6)
    np.testing.assert_allclose(adv[0, 1], [1.346, 0.3], atol=1e-6)


def test_oracle_reproduces_worked_example():
    r, _, m, sm, term, trunc = (np.asarray(x) for x in _episode(WE_V, WE_LEN))
    v = WE_V.astype(np.float64)[None, None]
    v[0, 0, 0, :] = [0.5, 0.6, 0.4]                  # exact float64 values
    v[0, 0, 1, :2] = [0.7, 0.8]
    adv, ret = backups_reference.token_level_gae_reference(
        r, v, m, sm, term, trunc, np.array([0.6]), gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv[0, 0], WE_A_TERMINAL, atol=1e-12)
    np.testing.assert_allclose(ret[0, 0], WE_R_TERMINAL, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Random episodes vs the NumPy loop oracles.

SHAPE = (3, 3, 3, 3)   # S > 1, three agents; empty and one-token responses are drawn too
SINGLE_AGENT_SHAPE = (3, 4, 1, 3)


def make_batch(shape, seed, p_empty, end_mode, g1_rows=False):
    """Random whole-episode rows ([S, B, ...] arrays, NumPy)."""
    s_, b_, n_, k_ = shape
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, k_ + 1, size=(s_, b_, n_))
    lengths = np.where(rng.random((s_, b_, n_)) < p_empty, 0, lengths)
    act_mask = np.arange(k_) < lengths[..., None]
    if g1_rows:   # G1 rollouts: every step played, episodes auto-reset inside a row
        step_mask = np.ones((s_, b_), bool)
        terminal = rng.random((s_, b_)) < 0.4
        truncated = np.zeros((s_, b_), bool)
    else:
        s_star = rng.integers(-1 if end_mode == "any" else 0, s_, size=b_)   # -1: nothing played
        step_mask = np.arange(s_)[:, None] <= s_star[None, :]
        at_end = np.arange(s_)[:, None] == s_star[None, :]
        mode = rng.integers(0, 4, size=b_) if end_mode == "any" else np.full(b_, end_mode)
        terminal = at_end & ((mode == 0) | (mode == 3))
        truncated = at_end & ((mode == 1) | (mode == 3))      # mode 2: neither, 3: both
    dp_tok = act_mask & step_mask[:, :, None, None]
    value = rng.normal(size=(s_, b_, n_, k_)).astype(np.float32)
    reward = (rng.normal(size=(s_, b_, n_, k_)) * (rng.random((s_, b_, n_, k_)) < 0.3)).astype(np.float32)
    reward = np.where(dp_tok, reward, 0.0).astype(np.float32)
    v_boot = rng.normal(size=b_).astype(np.float32)
    return dict(act_mask=act_mask, step_mask=step_mask, terminal=terminal, truncated=truncated,
                value=value, reward=reward, v_boot=v_boot, rng=rng)


gammas = st.sampled_from([(0.9, 0.8), (0.99, 0.95), (1.0, 1.0), (0.5, 0.0)])


@HYP
@given(shape=st.sampled_from([SHAPE, SINGLE_AGENT_SHAPE]), seed=st.integers(0, 2**31 - 1),
       p_empty=st.sampled_from([0.0, 0.3, 0.8]), gl=gammas)
def test_token_level_matches_oracle(shape, seed, p_empty, gl):
    d = make_batch(shape, seed, p_empty, "any")
    dp = d["act_mask"] & d["step_mask"][:, :, None, None]
    args = (d["reward"], d["value"], dp, d["step_mask"], d["terminal"], d["truncated"], d["v_boot"])
    want_adv, want_ret = backups_reference.token_level_gae_reference(*args, gamma=gl[0], lam=gl[1])
    for impl in IMPLS:
        adv, ret = run("token_level_gae", *args, impl=impl, gamma=gl[0], lam=gl[1])
        np.testing.assert_allclose(adv, want_adv, atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(ret, want_ret, atol=ATOL, rtol=1e-5)
        assert np.all(adv[~dp] == 0) and np.all(ret[~dp] == 0)


@HYP
@given(seed=st.integers(0, 2**31 - 1),
       p_empty=st.sampled_from([0.0, 0.3, 0.8]), gl=gammas)
def test_action_level_matches_oracle(seed, p_empty, gl):
    shape = SHAPE
    d = make_batch(shape, seed, p_empty, "any")
    dp = np.asarray(layout.action_decision_mask(d["act_mask"], d["step_mask"]))
    reward = np.where(dp, d["reward"].sum(-1), 0.0).astype(np.float32)
    value = d["value"][..., 0]
    args = (reward, value, dp, d["step_mask"], d["terminal"], d["truncated"], d["v_boot"])
    want_adv, want_ret = backups_reference.action_level_gae_reference(*args, gamma=gl[0], lam=gl[1])
    for impl in IMPLS:
        adv, ret = run("action_level_gae", *args, impl=impl, gamma=gl[0], lam=gl[1])
        np.testing.assert_allclose(adv, want_adv, atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(ret, want_ret, atol=ATOL, rtol=1e-5)


@HYP
@given(seed=st.integers(0, 2**31 - 1),
       p_empty=st.sampled_from([0.0, 0.4]), gl=gammas, level=st.sampled_from(["token", "action"]))
def test_reference_semantics_matches_g1_masks_oracle(seed, p_empty, gl, level):
    """G1-style rows (every step played, terminal anywhere, auto-reset) with quirk #10."""
    shape = SHAPE
    d = make_batch(shape, seed, p_empty, "any", g1_rows=True)
    if level == "token":
        dp = d["act_mask"]
        reward, value = d["reward"], d["value"]
        oracle, fn = backups_reference.token_level_gae_reference, "token_level_gae"
    else:
        dp = np.asarray(layout.action_decision_mask(d["act_mask"], d["step_mask"]))
        reward, value = np.where(dp, d["reward"].sum(-1), 0).astype(np.float32), d["value"][..., 0]
        oracle, fn = backups_reference.action_level_gae_reference, "action_level_gae"
    args = (reward, value, dp, d["step_mask"], d["terminal"], d["truncated"], d["v_boot"])
    want_adv, _ = oracle(*args, gamma=gl[0], lam=gl[1], g1_masks=True)
    for impl in ("scan", "blocked", "native"):   # associative shares scan's link factors
        adv, _ = run(fn, *args, impl=impl, reference_semantics=True, gamma=gl[0], lam=gl[1])
        np.testing.assert_allclose(adv, want_adv, atol=ATOL, rtol=1e-5)


@HYP
@given(seed=st.integers(0, 2**31 - 1),
       p_empty=st.sampled_from([0.0, 0.3, 0.8]), gl=gammas, level=st.sampled_from(["token", "action"]))
def test_independent_matches_oracle(seed, p_empty, gl, level):
    shape = SHAPE
    d = make_batch(shape, seed, p_empty, "any")
    v_boot = d["rng"].normal(size=shape[1:3]).astype(np.float32)
    if level == "token":
        dp = d["act_mask"] & d["step_mask"][:, :, None, None]
        reward, value = d["reward"], d["value"]
    else:
        dp = np.asarray(layout.action_decision_mask(d["act_mask"], d["step_mask"]))
        reward, value = np.where(dp, d["reward"].sum(-1), 0).astype(np.float32), d["value"][..., 0]
    args = (reward, value, dp, d["step_mask"], d["terminal"], d["truncated"], v_boot)
    want_adv, want_ret = backups_reference.independent_gae_reference(*args, gamma=gl[0], lam=gl[1])
    for impl in ("scan", "blocked", "native"):
        adv, ret = run("independent_gae", *args, impl=impl, gamma=gl[0], lam=gl[1])
        np.testing.assert_allclose(adv, want_adv, atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(ret, want_ret, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("impl", ["scan", "blocked", "native"])
def test_single_agent_matches_oracle_and_independent(impl):
    d = make_batch(SINGLE_AGENT_SHAPE, 7, 0.3, "any")
    dp = d["act_mask"] & d["step_mask"][:, :, None, None]
    args = (d["reward"], d["value"], dp, d["step_mask"], d["terminal"], d["truncated"])
    a1, _ = run("token_level_gae", *args, d["v_boot"], impl=impl, gamma=0.9, lam=0.8)
    want, _ = backups_reference.token_level_gae_reference(*args, d["v_boot"], gamma=0.9, lam=0.8)
    np.testing.assert_allclose(a1, want, atol=ATOL)
    a2, _ = run("independent_gae", *args, d["v_boot"][:, None], impl=impl, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(a1, a2, atol=1e-6)


def test_g1_code_transcription_action_and_token_level():
    """``reference_semantics=True`` equals a direct transcription of G1's buffer loops (all
    agents produce tokens, G1 masks[s+1] = 1 - done_s, masks[0] = 1, values[S] = next_value)."""
    s_, b_, n_, k_ = SHAPE
    rng = np.random.default_rng(3)
    done = rng.random((s_, b_)) < 0.4
    masks = np.ones((s_ + 1, b_, n_))
    masks[1:] = 1.0 - done[:, :, None]
    lengths = rng.integers(1, k_ + 1, size=(s_, b_, n_))
    act_mask = np.arange(k_) < lengths[..., None]
    next_value = rng.normal(size=b_)
    gamma, lam = 0.9, 0.8
    # action level (marft/buffers/action_level_buffer.py, compute_gae_and_returns)
    va = np.zeros((s_ + 1, b_, n_)); va[:s_] = rng.normal(size=(s_, b_, n_)); va[s_, :, 0] = next_value
    ra = rng.normal(size=(s_, b_, n_))
    adv_g1 = np.zeros((s_, b_, n_)); gae = 0
    for step in reversed(range(s_)):
        for agent in reversed(range(n_)):
            if agent == n_ - 1:
                delta = ra[step, :, agent] + gamma * va[step + 1, :, 0] * masks[step + 1, :, 0] - va[step, :, agent]
                gae = delta + gamma * lam * masks[step + 1, :, 0] * gae
            else:
                delta = ra[step, :, agent] + gamma * va[step, :, agent + 1] * masks[step, :, agent + 1] - va[step, :, agent]
                gae = delta + gamma * lam * masks[step, :, agent + 1] * gae
            adv_g1[step, :, agent] = gae
    ones = np.ones((s_, b_), bool)
    adv, _ = run("action_level_gae", ra.astype(np.float32), va[:s_].astype(np.float32),
                 np.ones((s_, b_, n_), bool), ones, done, np.zeros_like(done),
                 next_value.astype(np.float32), reference_semantics=True, gamma=gamma, lam=lam)
    np.testing.assert_allclose(adv, adv_g1, atol=1e-5)
    # token level (marft/buffers/token_level_buffer.py), last token from lengths, not pad ids
    vt = np.zeros((s_ + 1, b_, n_, k_)); vt[:s_] = rng.normal(size=(s_, b_, n_, k_)); vt[s_, :, 0, 0] = next_value
    rt = rng.normal(size=(s_, b_, n_))
    adv_g1 = np.zeros((s_, b_, n_, k_))
    for thread in range(b_):
        gae = 0
        for step in reversed(range(s_)):
            for agent in reversed(range(n_)):
                last_token = lengths[step, thread, agent] - 1
                for token in reversed(range(last_token + 1)):
                    rew = rt[step, thread, agent]
                    v = vt[step, thread, agent, token]
                    if token == last_token:
                        if agent == n_ - 1:
                            v_next, mask_next = vt[step + 1, thread, 0, 0], masks[step + 1, thread, 0]
                        else:
                            v_next, mask_next = vt[step, thread, agent + 1, 0], masks[step, thread, agent + 1]
                        delta = rew + gamma * v_next * mask_next - v
                        gae = delta + gamma * lam * mask_next * gae
                    else:
                        delta = gamma * vt[step, thread, agent, token + 1] - v
                        gae = delta + gamma * lam * gae
                    adv_g1[step, thread, agent, token] = gae
    reward = np.where(np.arange(k_) == (lengths - 1)[..., None], rt[..., None], 0.0).astype(np.float32)
    for impl in ("scan", "blocked", "native"):
        adv, _ = run("token_level_gae", reward, vt[:s_].astype(np.float32), act_mask, ones, done,
                     np.zeros_like(done), next_value.astype(np.float32), impl=impl,
                     reference_semantics=True, gamma=gamma, lam=lam)
        np.testing.assert_allclose(adv, adv_g1, atol=1e-5)


def test_reference_semantics_equal_default_on_terminal_whole_episodes():
    d = make_batch(SHAPE, 11, 0.3, 0)       # every row terminal at its last step
    dp = d["act_mask"] & d["step_mask"][:, :, None, None]
    args = (d["reward"], d["value"], dp, d["step_mask"], d["terminal"], d["truncated"], d["v_boot"])
    a1, _ = run("token_level_gae", *args, gamma=0.9, lam=0.8)
    a2, _ = run("token_level_gae", *args, reference_semantics=True, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(a1, a2, atol=1e-6)


def test_empty_responses_and_garbage_pads_give_no_nan():
    s_, b_, n_, k_ = SHAPE
    dp = np.zeros((s_, b_, n_, k_), bool)
    dp[0, 1, 1, :2] = True                          # one row has two tokens, the rest nothing
    value = np.where(dp, 0.5, np.nan).astype(np.float32)
    reward = np.where(dp, 1.0, np.nan).astype(np.float32)
    sm = np.ones((s_, b_), bool)
    sm[2] = False
    term = np.array([[False] * b_, [True] * b_, [False] * b_])
    for impl in IMPLS:
        adv, ret = run("token_level_gae", reward, value, dp, sm, term, np.zeros_like(term),
                       np.full(b_, np.nan, np.float32), impl=impl, gamma=1.0, lam=1.0)
        assert np.all(np.isfinite(adv)) and np.all(np.isfinite(ret))
        assert np.all(adv[~dp] == 0)
        np.testing.assert_allclose(adv[0, 1, 1, :2], [1.5, 1.0 - 0.5 + 0.0], atol=1e-6)


def test_associative_matches_oracle_on_long_rows():
    """Precision of the log-depth combine on a longer sequence (P = 2 * 2 * 48 per row)."""
    d = make_batch((2, 2, 2, 48), 5, 0.2, "any")
    dp = d["act_mask"] & d["step_mask"][:, :, None, None]
    args = (d["reward"], d["value"], dp, d["step_mask"], d["terminal"], d["truncated"], d["v_boot"])
    adv, ret = run("token_level_gae", *args, impl="associative", gamma=0.99, lam=0.95)
    want_adv, want_ret = backups_reference.token_level_gae_reference(*args, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(adv, want_adv, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [8, 13, 40, 67])
@pytest.mark.parametrize("gl", [(0.99, 0.95), (1.0, 1.0), (0.5, 0.0)])
def test_native_long_responses_match_oracle(k, gl):
    """Responses longer than the kernel's vector blocks (K = 8 fills one, 67 leaves a tail)."""
    d = make_batch((3, 5, 2, k), k, 0.2, "any")
    dp = d["act_mask"] & d["step_mask"][:, :, None, None]
    garbage = ~dp & (d["rng"].random(dp.shape) < 0.5)       # NaN pads: must not propagate
    value = np.where(garbage, np.nan, d["value"]).astype(np.float32)
    args = (d["reward"], value, dp, d["step_mask"], d["terminal"], d["truncated"])
    want_adv, want_ret = backups_reference.token_level_gae_reference(
        *args, d["v_boot"], gamma=gl[0], lam=gl[1])
    adv, ret = run("token_level_gae", *args, d["v_boot"], impl="native", gamma=gl[0], lam=gl[1])
    np.testing.assert_allclose(adv, want_adv, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-4, rtol=1e-5)
    v_boot = d["rng"].normal(size=(5, 2)).astype(np.float32)
    want_adv, want_ret = backups_reference.independent_gae_reference(
        *args, v_boot, gamma=gl[0], lam=gl[1])
    adv, ret = run("independent_gae", *args, v_boot, impl="native", gamma=gl[0], lam=gl[1])
    np.testing.assert_allclose(adv, want_adv, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("reference_semantics", [False, True])
def test_native_any_mask_matches_scan(reference_semantics):
    """Validity that is not a prefix per response (holes): the kernel's masked path."""
    d = make_batch((3, 4, 3, 21), 9, 0.2, "any", g1_rows=reference_semantics)
    holes = d["rng"].random(d["act_mask"].shape) < 0.3
    dp = d["act_mask"] & ~holes
    value = np.where(dp, d["value"], np.nan).astype(np.float32)
    reward = np.where(dp, d["reward"], np.nan).astype(np.float32)
    args = (reward, value, dp, d["step_mask"], d["terminal"], d["truncated"], d["v_boot"])
    want = run("token_level_gae", *args, impl="scan", reference_semantics=reference_semantics,
               gamma=0.9, lam=0.8)
    got = run("token_level_gae", *args, impl="native", reference_semantics=reference_semantics,
              gamma=0.9, lam=0.8)
    for w, g in zip(want, got):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    v_boot = d["rng"].normal(size=(4, 3)).astype(np.float32)
    want = run("independent_gae", *args[:-1], v_boot, impl="scan", gamma=0.9, lam=0.8)
    got = run("independent_gae", *args[:-1], v_boot, impl="native", gamma=0.9, lam=0.8)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", ["full", "random"])
def test_native_matches_blocked_at_bench_shape(lengths):
    """The benchmark's shape (131k decision points), full and random lengths."""
    from marft_jax.bench import backups as bench

    args = bench.make_inputs(2, 32, 4, 512, lengths, 3)
    want = run("token_level_gae", *args, impl="blocked", gamma=0.99, lam=0.95)
    got = run("token_level_gae", *args, impl="native", gamma=0.99, lam=0.95)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("width", [4, 8, 16])
def test_native_vector_widths_match_scan(width):
    """Each vector path of the kernel (capped width; the CPU may lack the wider ones) against
    the scan implementation, chained (both semantics) and independent."""
    skip_unless_native()
    s_, b_, n_, k_ = 3, 5, 3, 45
    rng = np.random.default_rng(width)
    lengths = rng.integers(0, k_ + 1, size=(s_, b_, n_))
    dp = np.arange(k_) < lengths[..., None]
    dp[0, 0, 1] = rng.random(k_) < 0.5                           # one response with holes
    step_mask = np.ones((s_, b_), bool)
    step_mask[2, 3] = False
    terminal = rng.random((s_, b_)) < 0.4
    truncated = rng.random((s_, b_)) < 0.5
    valid = dp & step_mask[:, :, None, None]
    reward = np.where(valid, rng.normal(size=dp.shape), np.nan).astype(np.float32)
    value = np.where(valid, rng.normal(size=dp.shape), np.nan).astype(np.float32)
    args = (reward, value, dp, step_mask, terminal, truncated)
    for independent, ref in ((False, False), (False, True), (True, False)):
        v_boot = rng.normal(size=(b_, n_) if independent else b_).astype(np.float32)
        got = native.backup(*args, v_boot.reshape(-1), gamma=0.97, lam=0.9,
                            independent=independent, reference_semantics=ref, max_width=width)
        if independent:
            want = run("independent_gae", *args, v_boot, impl="scan", gamma=0.97, lam=0.9)
        else:
            want = run("token_level_gae", *args, v_boot, impl="scan", reference_semantics=ref,
                       gamma=0.97, lam=0.9)
        for w, g in zip(want, got):
            np.testing.assert_allclose(np.asarray(g), w, atol=1e-5, rtol=1e-5)


def _end_cases():
    """Rows hitting each branch of the link/bootstrap logic ([S, B] = [4, 9], N = 3, K = 5)."""
    s_, b_, n_, k_ = 4, 9, 3, 5
    lengths = np.full((s_, b_, n_), 3)
    sm = np.ones((s_, b_), bool)
    term = np.zeros((s_, b_), bool)
    trunc = np.zeros((s_, b_), bool)
    term[1, 0] = True; lengths[1, 0] = 0                # terminal step without valid points,
    lengths[0, 0, 2] = 0                                #   last agent of step 0 empty
    term[3, 1] = True; lengths[3, 1] = 0                # ... at the end of the row
    term[1, 2] = term[2, 2] = True; lengths[2, 2] = 0   # two terminal steps in a row
    lengths[1, 2, 1:] = 0
    sm[2:, 3] = False; term[1, 3] = trunc[1, 3] = True  # truncated and terminal at s*
    sm[2:, 4] = False; trunc[1, 4] = True               # truncated at s* (bootstrap)
    sm[:, 5] = False; trunc[0, 5] = True                # nothing played
    sm[3, 6] = False; lengths[:3, 6] = 0; trunc[2, 6] = True   # played, no valid point
    trunc[1, 7] = True; term[2, 7] = True               # truncated before the end (ignored)
    term[0, 8] = True; lengths[1, 8, 0] = 0             # episode reset, first agent empty
    dp = np.arange(k_) < lengths[..., None]
    rng = np.random.default_rng(0)
    valid = dp & sm[:, :, None, None]
    reward = np.where(valid, rng.normal(size=dp.shape), np.nan).astype(np.float32)
    value = np.where(valid, rng.normal(size=dp.shape), np.nan).astype(np.float32)
    return reward, value, dp, sm, term, trunc


@pytest.mark.parametrize("level", ["token", "action"])
def test_native_link_and_bootstrap_branches(level):
    """Terminal steps without valid points (mid-row and last), truncated-and-terminal,
    unplayed steps, rows with nothing played or no valid point: native against ``blocked``,
    ``scan`` and the oracles, both semantics and independent."""
    reward, value, dp, sm, term, trunc = _end_cases()
    if level == "action":
        reward, value, dp = reward[..., 0], value[..., 0], dp[..., 0]
    fn = f"{level}_level_gae"
    oracle = getattr(backups_reference, f"{level}_level_gae_reference")
    args = (reward, value, dp, sm, term, trunc)
    b_, n_ = sm.shape[1], dp.shape[2]
    v_boot = np.linspace(-1.0, 1.0, b_).astype(np.float32)
    for ref in (False, True):
        got = run(fn, *args, v_boot, impl="native", reference_semantics=ref, gamma=0.9, lam=0.8)
        for impl in ("blocked", "scan"):
            want = run(fn, *args, v_boot, impl=impl, reference_semantics=ref, gamma=0.9, lam=0.8)
            for w, g in zip(want, got):
                assert np.all(np.isfinite(g))
                np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    clean = tuple(np.nan_to_num(x) for x in (reward, value))
    want = oracle(*clean, *args[2:], v_boot, gamma=0.9, lam=0.8)
    got = run(fn, *args, v_boot, impl="native", gamma=0.9, lam=0.8)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    v_boot = np.linspace(-1.0, 1.0, b_ * n_).astype(np.float32).reshape(b_, n_)
    got = run("independent_gae", *args, v_boot, impl="native", gamma=0.9, lam=0.8)
    want_i = backups_reference.independent_gae_reference(*clean, *args[2:], v_boot,
                                                         gamma=0.9, lam=0.8)
    for impl in ("blocked", "scan"):
        want = run("independent_gae", *args, v_boot, impl=impl, gamma=0.9, lam=0.8)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    for w, g in zip(want_i, got):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn_name,level,cast", [("token_level_gae", "token", False),
                                               ("action_level_gae", "action", False),
                                               ("independent_gae", "token", False),
                                               ("token_level_gae", "token", True)])
def test_native_program_is_one_custom_call(fn_name, level, cast):
    """The jitted native backup compiles to the FFI call alone (no fusion or other compute),
    so XLA's CPU runtime runs it inline; any JAX glue around it would regress that."""
    skip_unless_native()
    s_, b_, n_, k_ = 2, 3, 2, 4
    tok = (s_, b_, n_, k_) if level == "token" else (s_, b_, n_)
    fdt = jnp.bfloat16 if cast else jnp.float32     # a non-float32 input adds only its convert
    v_boot = (b_, n_) if fn_name == "independent_gae" else (b_,)
    args = (jax.ShapeDtypeStruct(tok, fdt), jax.ShapeDtypeStruct(tok, fdt),
            jax.ShapeDtypeStruct(tok, bool), *[jax.ShapeDtypeStruct((s_, b_), bool)] * 3,
            jax.ShapeDtypeStruct(v_boot, jnp.float32))
    fn = jax.jit(functools.partial(getattr(backups, fn_name), impl="native", gamma=0.99,
                                   lam=0.95))
    hlo = fn.lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    # "%name = <shape or (tuple shape)> opcode(operands), ..."
    ops = [m.group(1) for m in re.finditer(r"%\S+ = (?:\([^)]*\)|\S+) ([a-z][a-z0-9-]*)\(",
                                           entry)]
    allowed = {"parameter", "constant", "custom-call", "get-tuple-element", "tuple", "bitcast"}
    if cast:
        allowed |= {"convert", "fusion"}          # the casts of reward and value only
        assert ops.count("convert") + ops.count("fusion") <= 2, entry
    assert ops.count("parameter") == 7 and ops.count("custom-call") == 1, entry
    assert set(ops) <= allowed, entry


def test_native_auto_and_cache():
    """``auto`` picks the kernel on a single CPU device; a second build hits the cache."""
    skip_unless_native()
    assert jax.device_count() == 1
    assert backups.resolve_impl("auto") == "native"
    path = Path(native.status().library)
    mtime = path.stat().st_mtime_ns
    again, compiled, compile_s = native.build()
    assert (again, compiled, compile_s) == (path, False, None)
    assert path.stat().st_mtime_ns == mtime


NO_COMPILER_SCRIPT = textwrap.dedent("""
    import jax.numpy as jnp
    from marft_jax.rl import backups, native
    st = native.status()
    assert not st.available and "/nonexistent" in st.reason, st
    assert backups.resolve_impl("auto") == "blocked"
    s, b, n, k = 2, 3, 2, 4
    dp = jnp.ones((s, b, n, k), bool)
    args = (jnp.ones((s, b, n, k)), jnp.ones((s, b, n, k)), dp, jnp.ones((s, b), bool),
            jnp.zeros((s, b), bool), jnp.zeros((s, b), bool), jnp.zeros(b))
    adv, _ = backups.token_level_gae(*args)
    assert adv.shape == (s, b, n, k)
    try:
        backups.token_level_gae(*args, impl="native")
    except native.NativeUnavailable as e:
        assert "/nonexistent" in str(e), e
    else:
        raise AssertionError("impl='native' did not raise")
    print("OK")
""")


def test_native_without_compiler_falls_back(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CXX="/nonexistent/c++", MARFT_JAX_CACHE=str(tmp_path),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", NO_COMPILER_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
    assert not any(tmp_path.iterdir())


def test_input_layout_is_checked():
    v = jnp.zeros((2, 3, 4, 5))
    with pytest.raises(AssertionError, match="dp_mask"):
        backups.token_level_gae(v, v, jnp.ones((2, 3, 4, 6), bool), jnp.ones((2, 3), bool),
                                jnp.ones((2, 3), bool), jnp.ones((2, 3), bool), jnp.zeros(3))
    with pytest.raises(AssertionError, match="terminal"):
        backups.token_level_gae(v, v, jnp.ones((2, 3, 4, 5), bool), jnp.ones((2, 3), bool),
                                jnp.ones((3, 2), bool), jnp.ones((2, 3), bool), jnp.zeros(3))


# ----------------------------------------------------------------------------------------------
# Rewards.


@functools.lru_cache(maxsize=None)
def _place_jit(reward_to):
    return jax.jit(functools.partial(rewards.place_reward, reward_to=reward_to))


def _place_oracle(reward, dp, step_mask, reward_to):
    """NumPy loops over §4 placement. dp: [S, B, N, K] (token) or [S, B, N] (action)."""
    action = dp.ndim == 3
    dp4 = dp[..., None] if action else dp
    s_, b_, n_, k_ = dp4.shape
    out = np.zeros(dp4.shape)
    for b in range(b_):
        played = [s for s in range(s_) if step_mask[s, b]]
        if not played:
            continue
        s_star = played[-1]
        if reward_to == "last":
            slots = [(s, i, k) for s in range(s_star + 1) for i in range(n_) for k in range(k_)]
            valid = [p for p in slots if dp4[(p[0], b, p[1], p[2])]]
            if valid:
                s, i, k = valid[-1]
                out[s, b, i, k] = reward[b]
        else:
            for i in range(n_):
                toks = [k for k in range(k_) if dp4[s_star, b, i, k]]
                if toks:
                    out[s_star, b, i, toks[-1]] = reward[b, i] if reward.ndim == 2 else reward[b]
    return out[..., 0] if action else out


@HYP
@given(seed=st.integers(0, 2**31 - 1),
       p_empty=st.sampled_from([0.0, 0.5, 0.9]), reward_to=st.sampled_from(["last", "all"]),
       level=st.sampled_from(["token", "action"]), per_agent=st.booleans())
def test_place_reward_matches_oracle(seed, p_empty, reward_to, level, per_agent):
    shape = SHAPE
    d = make_batch(shape, seed, p_empty, "any")
    if level == "token":
        dp = np.asarray(layout.token_decision_mask(d["act_mask"], d["step_mask"]))
    else:
        dp = np.asarray(layout.action_decision_mask(d["act_mask"], d["step_mask"]))
    per_agent = per_agent and reward_to == "all"
    r = d["rng"].normal(size=shape[1:3] if per_agent else shape[1:2]).astype(np.float32)
    got = np.asarray(_place_jit(reward_to)(jnp.asarray(r), jnp.asarray(dp), jnp.asarray(d["step_mask"])))
    np.testing.assert_array_equal(got, _place_oracle(r, dp, d["step_mask"], reward_to))
    assert np.all(got[~dp] == 0)


def test_place_reward_last_moves_to_earlier_agent_and_step():
    dp = np.zeros((2, 1, 2, 3), bool)
    dp[0, 0, 1, :2] = True                          # step 0: agent 1 has two tokens
    sm = np.ones((2, 1), bool)                      # step 1 played, nobody produced tokens
    got = np.asarray(rewards.place_reward(jnp.array([2.0]), jnp.asarray(dp), jnp.asarray(sm)))
    want = np.zeros_like(got)
    want[0, 0, 1, 1] = 2.0
    np.testing.assert_array_equal(got, want)
    got_all = np.asarray(rewards.place_reward(jnp.array([2.0]), jnp.asarray(dp), jnp.asarray(sm),
                                              reward_to="all"))
    np.testing.assert_array_equal(got_all, 0.0)     # `all` drops copies of empty agents


def test_transform_and_final_step_reward():
    r = jnp.array([0.0, 1.0, 0.5])
    np.testing.assert_allclose(rewards.transform_reward(r), r)
    np.testing.assert_allclose(rewards.transform_reward(r, bias=-0.5, scale=10.0, clip=20.0),
                               [-5.0, 5.0, 0.0])
    np.testing.assert_allclose(rewards.transform_reward(r, scale=100.0, clip=20.0), [0, 20, 20])
    np.testing.assert_allclose(rewards.transform_reward(r - 1, scale=100.0, clip=20.0), [-20, 0, -20])
    score = jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    sm = jnp.array([[True, True, False], [True, False, False]])
    np.testing.assert_allclose(rewards.final_step_reward(score, sm), [0.4, 0.2, 0.0])


def test_mix_independent_rewards():
    r = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    np.testing.assert_allclose(rewards.mix_independent_rewards(r), [[0.75, 0.25], [1, 1], [0, 0]])
    np.testing.assert_allclose(rewards.mix_independent_rewards(r, weight=1.0), r)
    np.testing.assert_allclose(rewards.mix_independent_rewards(r, weight=0.0), [[.5, .5], [1, 1], [0, 0]])


# ----------------------------------------------------------------------------------------------
# Layout.


def test_flatten_roundtrip_and_execution_order():
    s_, b_, n_, k_ = 2, 3, 4, 5
    x = jnp.arange(s_ * b_ * n_ * k_).reshape(s_, b_, n_, k_)
    flat = layout.flatten_decisions(x, "token")
    assert flat.shape == (b_, s_ * n_ * k_)
    for b in range(b_):
        want = [int(x[s, b, i, k]) for s in range(s_) for i in range(n_) for k in range(k_)]
        assert list(np.asarray(flat[b])) == want
    np.testing.assert_array_equal(layout.unflatten_decisions(flat, (s_, n_, k_)), x)
    xa = x[..., 0]
    fa = layout.flatten_decisions(xa, "action")
    assert list(np.asarray(fa[1])) == [int(xa[s, 1, i]) for s in range(s_) for i in range(n_)]
    np.testing.assert_array_equal(layout.unflatten_decisions(fa, (s_, n_)), xa)
    h = jnp.arange(s_ * b_ * n_ * k_ * 2).reshape(s_, b_, n_, k_, 2)     # trailing feature axis
    np.testing.assert_array_equal(layout.unflatten_decisions(layout.flatten_decisions(h), (s_, n_, k_)), h)
    fi = layout.flatten_agent_sequences(x, "token")
    assert fi.shape == (b_ * n_, s_ * k_)
    r = 2 * n_ + 3                                  # row r = (batch r // N, agent r % N)
    assert list(np.asarray(fi[r])) == [int(x[s, 2, 3, k]) for s in range(s_) for k in range(k_)]
    np.testing.assert_array_equal(layout.unflatten_agent_sequences(fi, (s_, n_, k_)), x)
    np.testing.assert_array_equal(
        layout.unflatten_agent_sequences(layout.flatten_agent_sequences(xa, "action"), (s_, n_)), xa)
    # time-major twins are the transposes of the row-major views and round-trip
    for lvl, arr, dec in (("token", x, (s_, n_, k_)), ("action", xa, (s_, n_))):
        tm = layout.time_major_decisions(arr, lvl)
        np.testing.assert_array_equal(tm, layout.flatten_decisions(arr, lvl).T)
        np.testing.assert_array_equal(layout.from_time_major_decisions(tm, dec), arr)
        tma = layout.time_major_agent_sequences(arr, lvl)
        np.testing.assert_array_equal(tma, layout.flatten_agent_sequences(arr, lvl).T)
        np.testing.assert_array_equal(layout.from_time_major_agent_sequences(tma, dec), arr)


def test_response_rows_and_agent_major_views_round_trip_numpy_and_jax():
    s_, b_, n_, k_ = 2, 3, 4, 5
    x = np.arange(s_ * b_ * n_ * k_).reshape(s_, b_, n_, k_)
    for arr, kind in ((x, np.ndarray), (jnp.asarray(x), jax.Array)):
        rows = layout.flatten_responses(arr)               # row (s*B + b)*N + i
        assert isinstance(rows, kind) and rows.shape == (s_ * b_ * n_, k_)
        np.testing.assert_array_equal(rows[(1 * b_ + 2) * n_ + 3], x[1, 2, 3])
        np.testing.assert_array_equal(layout.unflatten_responses(rows, (s_, b_, n_)), x)
        am = layout.agent_major(arr)                        # [N, S*B, K], row s*B + b
        assert isinstance(am, kind) and am.shape == (n_, s_ * b_, k_)
        np.testing.assert_array_equal(am[3, 1 * b_ + 2], x[1, 2, 3])
        np.testing.assert_array_equal(layout.from_agent_major(am, (s_, b_)), x)
        ag = layout.flatten_agents(arr[0])                  # [B*N, K], row b*N + i
        assert isinstance(ag, kind)
        np.testing.assert_array_equal(ag[2 * n_ + 3], x[0, 2, 3])
        np.testing.assert_array_equal(layout.unflatten_agents(ag, n_), x[0])
    # the (row, agent) rows are those of the per-agent sequences
    np.testing.assert_array_equal(layout.flatten_agents(x[0, :, :, 0]),
                                  layout.flatten_agent_sequences(jnp.asarray(x[:1, ..., 0]), "action")[:, 0])


def test_last_played_step_one_definition():
    step_mask = np.array([[1, 1, 0, 1], [1, 0, 0, 1], [0, 0, 0, 1]], bool)   # [S=3, B=4]
    np.testing.assert_array_equal(layout.last_played_step(step_mask), [1, 0, -1, 2])
    onehot = np.asarray(layout.last_played_onehot(step_mask))
    np.testing.assert_array_equal(onehot, [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]])
    x = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    np.testing.assert_array_equal(layout.at_step(x, onehot), [5, 2, 0, 12])
    np.testing.assert_array_equal(layout.at_last_played_step(x, step_mask), [5, 2, 0, 12])
    flags = np.array([[0, 1, 1, 0], [1, 0, 1, 0], [1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(layout.at_step(flags, onehot), [True, True, False, True])


def test_assert_layout_reports_name():
    dims = layout.assert_layout(jnp.zeros((2, 3, 4)), "value", layout.ACTION_AXES)
    assert dims == {"step": 2, "batch": 3, "agent": 4}
    with pytest.raises(AssertionError, match="reward"):
        layout.assert_layout(jnp.zeros((2, 3, 5)), "reward", layout.ACTION_AXES, sizes=dims)
    with pytest.raises(AssertionError, match="mask"):
        layout.assert_layout(jnp.zeros((2, 3)), "mask", layout.STEP_AXES, dtype=bool)


# ----------------------------------------------------------------------------------------------
# Sharding: the batch axis shards over a "data" mesh axis (8 simulated CPU devices).

SHARD_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from marft_jax.rl import backups
    assert len(jax.devices()) == 8, jax.devices()
    S, B, N, K = 2, 16, 3, 8
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random((S, B, N)) < 0.3, 0, rng.integers(1, K + 1, (S, B, N)))
    dp = np.arange(K) < lengths[..., None]
    sm = np.ones((S, B), bool); term = np.zeros((S, B), bool); term[1, ::2] = True
    trunc = np.zeros((S, B), bool); trunc[1, 1::2] = True
    args = [rng.normal(size=(S, B, N, K)).astype(np.float32) * dp,
            rng.normal(size=(S, B, N, K)).astype(np.float32), dp, sm, term, trunc,
            rng.normal(size=B).astype(np.float32)]
    mesh = Mesh(np.array(jax.devices()), ("data",))
    def put(x):
        spec = P("data") if x.ndim == 1 else P(None, "data")
        return jax.device_put(x, NamedSharding(mesh, spec))
    for impl in ("auto", "associative"):    # CPU default (blocked) and the accelerator default
        f = jax.jit(lambda *a: backups.token_level_gae(*a, gamma=0.99, lam=0.95, impl=impl))
        want = f(*[jax.device_put(a, jax.devices()[0]) for a in args])
        got = f(*[put(a) for a in args])
        for w, g in zip(want, got):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), g.ndim), g.sharding
            assert len(g.sharding.device_set) == 8
    print("OK")
""")


def test_sharded_batch_equals_unsharded():
    root = Path(__file__).resolve().parents[1]
    env = device_env(8, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", SHARD_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


@pytest.mark.parametrize("k,block", [(1, 16), (7, 16), (16, 16), (37, 8), (64, 16)])
@pytest.mark.parametrize("g", [0.0, 0.3, 0.97, 1.0])
def test_discounted_suffix_sum_matches_loop(k, block, g):
    x = np.random.default_rng(k).normal(size=(3, 2, k)).astype(np.float32)
    want = np.zeros_like(x)
    acc = np.zeros(x.shape[:-1], np.float64)
    for j in reversed(range(k)):
        acc = x[..., j] + g * acc
        want[..., j] = acc
    got = jax.jit(backups.discounted_suffix_sum, static_argnames="block")(x, g, block=block)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gl", [(1.0, 1.0), (0.99, 0.95)])
def test_g1_buffer_loop_baseline_matches_ours(gl):
    from marft_jax.bench import backups as bench, g1_token_gae

    args = bench.make_inputs(2, 3, 3, 6, "full", 0)
    buf = g1_token_gae.g1_buffers(*args)
    g1_token_gae.g1_token_gae(buf, *gl)
    adv, ret = run("token_level_gae", *args, gamma=gl[0], lam=gl[1])
    np.testing.assert_allclose(g1_token_gae.advantages_canonical(buf), adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(buf.returns[0], ret, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="empty responses"):
        g1_token_gae.g1_buffers(*bench.make_inputs(1, 8, 3, 6, "random", 1))
