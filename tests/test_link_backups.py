"""Backups and reward placement along a team graph's link table (``team.layer_links=layer``):
every implementation against a plain NumPy loop over the table, hand-built tables for a
mixture (2 proposers + aggregator) and a debate (2 debaters, 2 steps), action and token level,
with empty responses, terminal and truncated steps; the chain table is the default call bit for
bit."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.bench import reference_backups as backups_reference
from marft_jax.rl import backups, native, rewards
from marft_jax.rl import topology as topo

IMPLS = ("scan", "associative", "blocked", "native")


def _table(succ, skip, succ_x, skip_x):
    return topo.LinkTable("table", np.array(succ), np.array(skip), np.array(succ_x, bool), np.array(skip_x, bool))


# Hand-built tables (chunk c = s * N + i, C = S * N the end).
MIXTURE = _table(                       # S = 2, N = 3: proposers 0, 1 -> aggregator 2 -> next step
    succ=[[2, 2, 3], [5, 5, 6]], skip=[[1, 2, 3], [4, 5, 6]],
    succ_x=[[0, 0, 1], [0, 0, 1]], skip_x=[[0, 0, 1], [0, 0, 1]])
DEBATE = _table(                        # S = 2, N = 2: both debaters -> next round's first debater
    succ=[[2, 2], [4, 4]], skip=[[1, 2], [3, 4]],
    succ_x=[[1, 1], [1, 1]], skip_x=[[0, 1], [0, 1]])


def test_hand_built_tables_are_the_topologys():
    assert topo.named("mixture", ("a", "b", "agg")).links(2, "layer") == MIXTURE
    assert topo.named("debate", ("pro", "con")).links(2, "layer") == DEBATE


# ----------------------------------------------------------------------------------------------
# The oracle: a plain loop over the table, one row, one response at a time (memoized).


def oracle(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, table, *, gamma, lam):
    """float64 ``(adv, ret)`` in the input layout (``[S, B, N]`` or ``[S, B, N, K]``)."""
    action = np.ndim(value) == 3
    grow = (lambda x: np.asarray(x)[..., None]) if action else np.asarray
    r, v = grow(reward).astype(np.float64), grow(value).astype(np.float64)
    dp = grow(dp_mask).astype(bool) & np.asarray(step_mask, bool)[:, :, None, None]
    S, B, N, K = v.shape
    C = S * N
    adv = np.zeros_like(v)
    for b in range(B):
        played = [s for s in range(S) if step_mask[s, b]]
        s_star = played[-1] if played else None
        boot = s_star is not None and truncated[s_star, b] and not terminal[s_star, b]
        v_end = float(v_boot[b]) if boot else 0.0
        term = [bool(terminal[s, b] and step_mask[s, b]) for s in range(S)]
        toks = lambda c: [k for k in range(K) if dp[c // N, b, c % N, k]]
        done = set()

        def enter(d):
            """(V, A, cut) at the first valid point reached from link target d."""
            cut = False
            while d != C:
                s, i = divmod(d, N)
                t = toks(d)
                if t:
                    solve(d)
                    return v[s, b, i, t[0]], adv[s, b, i, t[0]], cut
                cut = cut or (bool(table.skip_crosses[s, i]) and term[s])
                d = int(table.skip[s, i])
            return v_end, 0.0, cut

        def solve(c):
            if c in done:
                return
            s, i = divmod(c, N)
            t = toks(c)
            v_n, a_n, cut = enter(int(table.succ[s, i]))
            f = 0.0 if (cut or (bool(table.succ_crosses[s, i]) and term[s])) else 1.0
            for pos in reversed(range(len(t))):
                k = t[pos]
                if pos == len(t) - 1:
                    nv, na, fk = v_n, a_n, f
                else:
                    nv, na, fk = v[s, b, i, t[pos + 1]], adv[s, b, i, t[pos + 1]], 1.0
                delta = r[s, b, i, k] + gamma * fk * nv - v[s, b, i, k]
                adv[s, b, i, k] = delta + gamma * lam * fk * na
            done.add(c)

        for c in range(C):
            if toks(c):
                solve(c)
    ret = np.where(dp, adv + v, 0.0)
    if action:
        return adv[..., 0], ret[..., 0]
    return adv, ret


# ----------------------------------------------------------------------------------------------
# Batches: empty responses, a terminal step, truncation with bootstrap, unplayed steps.


def _batch(num_agents, level, seed):
    """Rows of 2 steps: 0 whole 2-step episode (terminal at 1); 1 terminal at step 0, step 1 not
    played; 2 truncated at step 1 (bootstrap); 3 terminal at 0 and auto-reset into step 1
    (the cut inside the row); 4 first proposer/debater empty at step 0, truncated; 5 the last
    agent empty at step 1 and the whole step 0 empty. Token lengths vary, some right pads hold
    NaN."""
    rng = np.random.default_rng(seed)
    S, B, N, K = 2, 6, num_agents, 4
    step_mask = np.ones((S, B), bool)
    step_mask[1, 1] = False
    terminal = np.zeros((S, B), bool)
    terminal[1, 0] = terminal[0, 1] = terminal[0, 3] = terminal[1, 3] = terminal[1, 5] = True
    truncated = np.zeros((S, B), bool)
    truncated[1, 2] = truncated[1, 4] = True
    length = rng.integers(1, K + 1, size=(S, B, N))
    length[0, 4, 0] = 0
    length[1, 5, N - 1] = 0
    length[0, 5, :] = 0
    length[1, 0, 0] = 0
    value = rng.uniform(-1, 1, (S, B, N, K)).astype(np.float32)
    v_boot = rng.uniform(-1, 1, B).astype(np.float32)
    if level == "action":
        dp = length > 0
        value = value[..., 0]
        value[~dp] = np.nan
    else:
        dp = np.arange(K) < length[..., None]
        value[~dp] = np.nan
    return value, dp, step_mask, terminal, truncated, v_boot


@functools.lru_cache(maxsize=None)
def _backup(impl, links):
    return jax.jit(functools.partial(backups.marft_gae, impl=impl, links=links))


@functools.lru_cache(maxsize=None)
def _place(links):
    return jax.jit(functools.partial(rewards.place_reward, links=links))


def _run(impl, links, reward, value, dp, step_mask, terminal, truncated, v_boot, gamma, lam):
    if impl == "native" and not native.status().available:
        pytest.skip(f"native backup kernel unavailable: {native.status().reason}")
    adv, ret = _backup(impl, links)(*(jnp.asarray(x) for x in (reward, value, dp, step_mask, terminal,
                                                              truncated, v_boot)), gamma=gamma, lam=lam)
    return np.asarray(adv), np.asarray(ret)


@pytest.mark.parametrize("level,gamma,lam", [("action", 0.9, 0.8), ("token", 1.0, 1.0), ("token", 0.9, 0.7)])
@pytest.mark.parametrize("name,table", [("mixture", MIXTURE), ("debate", DEBATE)])
def test_every_impl_matches_the_table_oracle(name, table, level, gamma, lam):
    value, dp, step_mask, terminal, truncated, v_boot = _batch(table.num_agents, level, seed=len(name))
    team_reward = np.linspace(0.5, 1.5, value.shape[1]).astype(np.float32)
    reward = np.asarray(_place(table)(jnp.asarray(team_reward), jnp.asarray(dp), jnp.asarray(step_mask)))
    # plus a few intermediate rewards anywhere (a reward inside a response is added to its delta)
    rng = np.random.default_rng(7)
    reward = np.where(rng.random(reward.shape) < 0.2, rng.uniform(-0.5, 0.5, reward.shape), reward)
    reward = reward.astype(np.float32)
    want_adv, want_ret = oracle(reward, value, dp, step_mask, terminal, truncated, v_boot, table,
                                gamma=gamma, lam=lam)
    assert np.isfinite(want_adv).all() and np.abs(want_adv).max() > 0.1
    for impl in IMPLS:
        adv, ret = _run(impl, table, reward, value, dp, step_mask, terminal, truncated, v_boot, gamma, lam)
        np.testing.assert_allclose(adv, want_adv, atol=1e-6, rtol=0, err_msg=impl)
        np.testing.assert_allclose(ret, want_ret, atol=1e-6, rtol=0, err_msg=impl)
    if level == "token":        # responses with holes (not right-padded): all but `blocked`
        holes = dp.copy()
        holes[..., 0] &= ~(dp[..., 1] & (rng.random(dp.shape[:3]) < 0.5))
        assert (holes != dp).any()
        want_adv, want_ret = oracle(reward, value, holes, step_mask, terminal, truncated, v_boot, table,
                                    gamma=gamma, lam=lam)
        for impl in ("scan", "associative", "native"):
            adv, ret = _run(impl, table, reward, value, holes, step_mask, terminal, truncated, v_boot, gamma, lam)
            np.testing.assert_allclose(adv, want_adv, atol=1e-6, rtol=0, err_msg=impl)
            np.testing.assert_allclose(ret, want_ret, atol=1e-6, rtol=0, err_msg=impl)


def test_layer_links_share_the_successor_and_cut_at_terminal_steps():
    """Hand-derived debate numbers (action level, gamma 0.5, lambda 1): round 0's debaters both
    link to round 1's first debater; a terminal round 0 cuts both links."""
    rows = lambda x: np.repeat(np.asarray(x), 6, axis=1)            # the oracle test's shapes
    v = rows(np.array([[[0.2, 0.4]], [[0.6, 0.8]]], np.float32))    # [S=2, B, N=2]
    r = rows(np.array([[[0.0, 0.0]], [[1.0, 1.0]]], np.float32))
    dp = np.ones(v.shape, bool)
    sm, trunc, vb = rows(np.ones((2, 1), bool)), rows(np.zeros((2, 1), bool)), np.zeros(6, np.float32)
    term = rows(np.array([[False], [True]]))
    # round 1: A = 1 - V (end, no bootstrap): 0.4, 0.2; round 0: A_i = 0.5 V(1,0) - V(0,i) + 0.5 A(1,0)
    want = rows([[[0.5 * 0.6 - 0.2 + 0.5 * 0.4, 0.5 * 0.6 - 0.4 + 0.5 * 0.4]], [[0.4, 0.2]]])
    cut = rows([[[-0.2, -0.4]], [[0.4, 0.2]]])
    for impl in IMPLS:
        adv, _ = _run(impl, DEBATE, r, v, dp, sm, term, trunc, vb, 0.5, 1.0)
        np.testing.assert_allclose(adv, want, atol=1e-6, err_msg=impl)
        adv, _ = _run(impl, DEBATE, r, v, dp, sm, rows([[True], [True]]), trunc, vb, 0.5, 1.0)
        np.testing.assert_allclose(adv, cut, atol=1e-6, err_msg=impl)


def test_the_general_table_path_on_the_chain_matches_the_chained_reference(level="token"):
    """The chain's successors given as a ``kind="table"`` table go through the link-table code
    (not the chained recurrence) and still match ``backups_reference`` (token level; the action
    level is the same code with K = 1)."""
    value, dp, step_mask, terminal, truncated, v_boot = _batch(3, level, seed=3)
    chain = topo.named("chain", ("a", "b", "c")).links(2)
    as_table = topo.LinkTable("table", chain.succ, chain.skip, chain.succ_crosses, chain.skip_crosses)
    reward = np.asarray(rewards.place_reward(jnp.ones(6), jnp.asarray(dp), jnp.asarray(step_mask)))
    placed = np.asarray(_place(as_table)(jnp.ones(6), jnp.asarray(dp), jnp.asarray(step_mask)))
    np.testing.assert_array_equal(placed, reward)
    ref = (backups_reference.action_level_gae_reference if level == "action"
           else backups_reference.token_level_gae_reference)
    want_adv, _ = ref(reward, np.nan_to_num(value), dp, step_mask, terminal, truncated, v_boot, gamma=0.9, lam=0.8)
    for impl in IMPLS:
        adv, _ = _run(impl, as_table, reward, value, dp, step_mask, terminal, truncated, v_boot, 0.9, 0.8)
        np.testing.assert_allclose(adv, want_adv, atol=1e-6, err_msg=impl)


@pytest.mark.parametrize("level", ["action", "token"])
def test_chain_table_is_the_default_call_bit_for_bit(level):
    """``links=<the chain table>`` runs today's chained program: results identical (==)."""
    value, dp, step_mask, terminal, truncated, v_boot = _batch(3, level, seed=5)
    chain = topo.named("mixture", ("a", "b", "c")).links(2, "chain")
    assert chain.kind == "chain"
    reward = rewards.place_reward(jnp.ones(6), jnp.asarray(dp), jnp.asarray(step_mask))
    np.testing.assert_array_equal(
        np.asarray(rewards.place_reward(jnp.ones(6), jnp.asarray(dp), jnp.asarray(step_mask), links=chain)),
        np.asarray(reward))
    for impl in IMPLS:
        args = (reward, value, dp, step_mask, terminal, truncated, v_boot)
        if impl == "native" and not native.status().available:
            continue
        default = jax.jit(functools.partial(backups.marft_gae, impl=impl))(
            *(jnp.asarray(x) for x in args), gamma=0.9, lam=0.8)
        linked = _run(impl, chain, *args, 0.9, 0.8)
        for d, g in zip(default, linked):
            assert np.array_equal(np.asarray(d), g), impl


@pytest.mark.parametrize("level", ["action", "token"])
def test_layer_reward_goes_to_every_agent_of_the_last_layer(level):
    """Debate: each debater of the final round gets a copy (``Topology.reward_receivers``); an
    empty debater gets nothing; a round without tokens passes it to the round before. Mixture:
    the aggregator, or both proposers when the aggregator is empty."""
    S, B, K = 2, 3, 3
    deb = topo.named("debate", ("pro", "con"))
    assert deb.reward_receivers("layer").tolist() == [True, True]
    length = np.full((S, B, 2), 2)
    length[1, 1, 1] = 0                      # row 1: con silent in the last round
    length[1, 2, :] = 0                      # row 2: nobody speaks in the last round
    dp = length > 0 if level == "action" else np.arange(K) < length[..., None]
    got = np.asarray(_place(DEBATE)(jnp.array([1.0, 2.0, 3.0]), jnp.asarray(dp), jnp.ones((S, B), bool)))
    per = got if level == "action" else got.sum(-1)
    np.testing.assert_array_equal(per, [[[0, 0], [0, 0], [3, 3]], [[1, 1], [2, 0], [0, 0]]])
    if level == "token":
        assert got[1, 0, 0, 1] == 1.0 and got[1, 0, 0, 0] == 0.0          # the last valid token
    length = np.full((1, 2, 3), 2)
    length[0, 1, 2] = 0                      # row 1: the aggregator is empty
    dp = length > 0 if level == "action" else np.arange(K) < length[..., None]
    mix = topo.named("mixture", ("a", "b", "agg")).links(1, "layer")
    got = np.asarray(_place(mix)(jnp.array([1.0, 2.0]), jnp.asarray(dp), jnp.ones((1, 2), bool)))
    per = got if level == "action" else got.sum(-1)
    np.testing.assert_array_equal(per, [[[0, 0, 1], [2, 2, 0]]])


def test_table_errors_name_the_problem():
    v = jnp.zeros((2, 1, 2))
    args = (v, v, jnp.ones((2, 1, 2), bool), jnp.ones((2, 1), bool), jnp.zeros((2, 1), bool),
            jnp.zeros((2, 1), bool), jnp.zeros(1))
    with pytest.raises(ValueError, match="reference_semantics"):
        backups.marft_gae(*args, gamma=1.0, lam=1.0, impl="scan", links=DEBATE, reference_semantics=True)
    with pytest.raises(ValueError, match="3 agent"):
        backups.marft_gae(*args, gamma=1.0, lam=1.0, impl="scan", links=MIXTURE)
    with pytest.raises(ValueError, match=r"v_boot \[B, N\]"):     # each agent's own bootstrap value
        backups.marft_gae(*args, gamma=1.0, lam=1.0, impl="scan",
                          links=topo.named("independent", ("a", "b")).links(2))
    with pytest.raises(ValueError, match="reference_semantics"):
        backups.marft_gae(*args[:-1], jnp.zeros((1, 2)), gamma=1.0, lam=1.0, impl="scan",
                          links=topo.named("independent", ("a", "b")).links(2), reference_semantics=True)
    not_own = dataclasses.replace(topo.per_agent_links(2, 2), succ=np.array([[3, 2], [4, 4]]))
    with pytest.raises(ValueError, match="itself"):
        backups.marft_gae(*args[:-1], jnp.zeros((1, 2)), gamma=1.0, lam=1.0, impl="scan", links=not_own)
    loop = _table([[1, 0]], [[1, 0]], [[0, 0]], [[0, 0]])
    with pytest.raises(ValueError, match="cycle"):
        backups.link_index(loop)


def test_native_linked_program_is_one_custom_call():
    """As for the chain: the jitted native link-table backup is the FFI call alone (the table is
    a constant operand), so XLA's CPU runtime runs it inline."""
    import re

    if not native.status().available:
        pytest.skip(f"native backup kernel unavailable: {native.status().reason}")
    s_, b_, n_, k_ = 2, 3, 3, 4
    args = (jax.ShapeDtypeStruct((s_, b_, n_, k_), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((s_, b_, n_, k_), bool),) + (jax.ShapeDtypeStruct((s_, b_), bool),) * 3 + (
        jax.ShapeDtypeStruct((b_,), jnp.float32),)
    fn = jax.jit(functools.partial(backups.marft_gae, impl="native", gamma=0.99, lam=0.95, links=MIXTURE))
    hlo = fn.lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    ops = [m.group(1) for m in re.finditer(r"%\S+ = (?:\([^)]*\)|\S+) ([a-z][a-z0-9-]*)\(", entry)]
    assert ops.count("parameter") == 7 and ops.count("custom-call") == 1, entry
    assert set(ops) <= {"parameter", "constant", "custom-call", "get-tuple-element", "tuple", "bitcast"}, entry
