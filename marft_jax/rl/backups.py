"""Bellman backups (GAE) along the execution order token -> agent -> step
(docs/algorithm.md#gae-backups).

All backups use one recurrence (docs/algorithm.md#one-recurrence-for-both). Per row, the
decision points are flattened in execution order (``layout.flatten_decisions``) to one axis
``p = 0 .. P-1`` with validity ``u_p``, reward ``r_p``, value ``V_p`` and link factor ``c_p``;
a virtual point ``P`` with ``V_P = V_end`` and ``A_P = 0`` is appended. With ``s(p)`` the next
valid point after ``p``::

    delta_p = r_p + gamma * c_p * V_{s(p)} - V_p
    A_p     = delta_p + gamma * lam * c_p * A_{s(p)}      (A_p = 0 where u_p = 0)
    R_p     = A_p + V_p                                    (R_p = 0 where u_p = 0)

This one masked reverse linear recurrence reproduces the action-level backup (one point per
agent, docs/algorithm.md#action-level-backup) and the token-level one
(docs/algorithm.md#token-level-backup): inside a response the next point is the next token; an
agent's last token links to the first token of the next agent that produced tokens (factor 1); the last
such agent of step s links to the first acting agent of the next step (factor ``e_s``); agents
and steps without tokens are skipped (no NaN, no crash).

Link factors and bootstrap (``reference_semantics=False``, the ``marft_jax`` semantics):

* ``c_p = 0`` iff ``p`` is the last valid point of a *terminal* played step, else 1 (if a
  terminal step has no valid point at all, the cut moves to the last valid point before it).
  Inside a step the chaining factor is 1.
* ``V_end = V_boot`` iff the row's last played step s* is ``truncated`` and not ``terminal``;
  otherwise ``V_end = 0`` (terminal rows never bootstrap; a row that is neither terminal nor
  truncated at s* is treated as ended without a bootstrap value). ``A_end = 0`` always: the
  trace is cut at the truncation.
* ``step_mask`` must be a prefix per row (steps 0 .. s* played); rewards and values off valid
  points are ignored (they may hold garbage, even NaN).

``reference_semantics=True`` reproduces G1's buffers (``marft/buffers/*_level_buffer.py``)
given G1-style masks ``mask_s = 1 - terminal_{s-1}`` (``mask_0 = 1``, G1 never writes it):

* quirk #10: the agent ``i -> i+1`` link inside step s is multiplied by the *current* step's
  mask, so for ``s >= 1`` with ``terminal[s-1]`` (the first step of an episode that auto-reset
  inside a row) ``c_p = 0`` at the last valid point of every agent ``i < N-1``. Whole-episode
  rows (terminal only at s*) are unaffected.
* bootstrap: ``V_end = V_boot * (1 - terminal[s*])``; G1 has no truncated flag (it bootstraps
  every unfinished segment end), so ``truncated`` is ignored.

G1's crash on empty token-level responses and its raw-observation bootstrap value (quirks #12,
#6) are not reproduced: empty responses are skipped, and ``v_boot`` is whatever the caller
passes.

Implementations (``impl``), all float32 and equal up to float rounding:

* ``"scan"``: one ``lax.scan(reverse=True)`` over p carrying (next valid value, advantage),
  the rows as the vector axis. Any ``dp_mask``.
* ``"associative"``: two ``lax.associative_scan(reverse=True)`` over the first-order linear
  recurrences ``x_p = a_p + b_p x_{p+1}`` (next valid value, then advantage) with
  ``combine((a_r, b_r), (a_l, b_l)) = (a_l + b_l a_r, b_l b_r)``. Log depth; best on GPU/TPU.
  Any ``dp_mask``.
* ``"blocked"``: the same recurrence solved per response (block = one agent's response):
  deltas in closed form, a short unrolled scan over the chunk sequence for the links between
  responses, then the in-response suffix sums as two small triangular matmuls
  (:func:`discounted_suffix_sum`), no loop over tokens and no transpose. Requires
  right-padded responses (``dp_mask[..., k] = k < K_{s,b,i}``, the layout contract); it reads
  ``K_{s,b,i} = sum_k dp_mask``. The fastest pure-XLA implementation on CPU.
* ``"native"``: a fused C++ kernel through the XLA FFI (:mod:`marft_jax.rl.native`), CPU
  only: the whole backup in one custom call on the raw inputs (validity, link factors and
  bootstrap as below, then one reverse pass per row directly on the ``[S, B, N, K]`` layout
  writing advantages and returns together; right-padded responses take a vectorised path
  that never reads past the last valid token, any other ``dp_mask`` a point-by-point masked
  path). The jitted program is that one call (plus reshapes), so XLA's CPU runtime runs it
  inline rather than on a worker thread. Built with the system C++ compiler at first use and
  cached; unavailable without a compiler (selecting it then raises, naming the reason). The
  call is not partitioned (with several devices it runs on gathered inputs), not
  differentiable, and ``vmap`` runs it once per batch element.
* ``"auto"`` (default): ``"native"`` when the default backend is CPU with a single device and
  the kernel is available; otherwise ``"blocked"`` on CPU, ``"associative"`` elsewhere.

Team graphs (``marft_gae(links=...)``, :mod:`marft_jax.rl.topology`): with a link table of
``kind="table"`` (``team.layer_links=layer``) a response's last valid point links to the
first valid point of its *successor* chunk instead of the next one in execution order
(several responses may share one); chunks without valid points forward the link through their
skip target; the link is cut where it leaves a terminal step. Every implementation above
solves it (:func:`_solve_linked`; native: a second kernel handler). The chain table
(``kind="chain"``) is the recurrence above, the very same program. The independent graph's
table (``kind="per_agent"``, :func:`~marft_jax.rl.topology.per_agent_links`: agent i's
response links to agent i's at the next step) ends each agent's sequence at its own bootstrap
value (``v_boot`` ``[B, N]``) and is solved per agent sequence (:func:`_per_agent_gae`; native:
the kernel's per-agent mode), the former independent-PPO program.

The batch axis carries no dependency, so it may be sharded (``NamedSharding`` with
``P(None, "data")`` on ``[S, B, ...]`` inputs); outputs keep that sharding (XLA
implementations; ``"auto"`` never picks ``"native"`` with several devices).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from marft_jax.rl import layout, native
from marft_jax.rl.topology import LinkTable, per_agent_links

IMPLS = ("auto", "scan", "associative", "blocked", "native")


class Backup(NamedTuple):
    """Advantages and returns in the input layout, float32, zero on invalid decision points."""

    advantages: jax.Array
    returns: jax.Array


def resolve_impl(impl: str) -> str:
    """The implementation ``impl`` stands for (module doc); the only place ``"auto"`` is decided.

    ``"auto"`` -> ``"native"`` on a single-device CPU backend when the kernel is available
    (this builds it on first use), else ``"blocked"`` on CPU and ``"associative"`` on
    accelerators. ``"native"`` raises :class:`marft_jax.rl.native.NativeUnavailable` naming
    the reason when the kernel cannot be built, and ``ValueError`` off the CPU backend.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    cpu = jax.default_backend() == "cpu"
    if impl == "auto":
        if not cpu:
            return "associative"
        return "native" if jax.device_count() == 1 and native.available() else "blocked"
    if impl == "native":
        if not cpu:
            raise ValueError(f"impl='native' is a CPU kernel; the default backend is "
                             f"{jax.default_backend()!r}")
        native.require()
    return impl


# ----------------------------------------------------------------------------------------------
# Core recurrences.


def _linear_combine(right, left):
    """Reverse-mode combine for ``x_p = a_p + b_p * x_{p+1}``.

    ``right`` is the already-combined part to the right (closer to the end), ``left`` the new
    element(s) on the left: the composition is ``x -> a_l + b_l * (a_r + b_r * x)``.
    """
    a_r, b_r = right
    a_l, b_l = left
    return a_l + b_l * a_r, b_l * b_r


def gae_time_major(
    reward: jax.Array,
    value: jax.Array,
    valid: jax.Array,
    link: jax.Array,
    value_end: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    impl: str = "scan",
    unroll: int = 1,
) -> jax.Array:
    """The unified masked reverse GAE recurrence, decision points leading
    (docs/algorithm.md#one-recurrence-for-both).

    Args:
      reward: ``[P, R]`` float, rewards placed on valid points (ignored elsewhere).
      value: ``[P, R]`` float, V_p (ignored off valid points).
      valid: ``[P, R]`` bool, u_p.
      link: ``[P, R]`` float, c_p (0 cuts both bootstrap and trace after p).
      value_end: ``[R]`` float, V of the virtual point P (bootstrap value or 0).
      gamma, lam: discount and GAE lambda.
      impl: ``"scan"`` or ``"associative"``.
      unroll: ``lax.scan`` unroll factor (``impl="scan"``).

    Returns:
      ``[P, R]`` float32 advantages, 0 where ``valid`` is False.
    """
    if impl not in ("scan", "associative"):
        raise ValueError(f"gae_time_major: impl must be 'scan' or 'associative', got {impl!r}")
    f32 = jnp.float32
    u = valid.astype(bool)
    r = jnp.where(u, reward.astype(f32), 0.0)
    v = jnp.where(u, value.astype(f32), 0.0)
    c = link.astype(f32)
    v_end = value_end.astype(f32)
    gamma = jnp.asarray(gamma, f32)
    gl = gamma * jnp.asarray(lam, f32)

    if impl == "scan":
        def step(carry, x):
            next_v, next_a = carry
            r_p, v_p, u_p, c_p = x
            a_p = jnp.where(u_p, r_p + gamma * c_p * next_v - v_p + gl * c_p * next_a, 0.0)
            return (jnp.where(u_p, v_p, next_v), jnp.where(u_p, a_p, next_a)), a_p

        init = (v_end, jnp.zeros_like(v_end))
        _, adv = lax.scan(step, init, (r, v, u, c), reverse=True, unroll=unroll)
        return adv

    # Next valid value after p: N_q = u_q V_q + (1 - u_q) N_{q+1}, N_P = V_end; V_{s(p)} = N_{p+1}.
    a_nv, b_nv = lax.associative_scan(
        _linear_combine, (v, jnp.where(u, 0.0, 1.0)), reverse=True, axis=0)
    n_q = a_nv + b_nv * v_end[None, :]
    v_next = jnp.concatenate([n_q[1:], v_end[None, :]], axis=0)
    delta = r + gamma * c * v_next - v
    # A_p = u_p delta_p + (u_p gamma lam c_p + 1 - u_p) A_{p+1}, A_P = 0.
    a_adv, _ = lax.associative_scan(
        _linear_combine, (jnp.where(u, delta, 0.0), jnp.where(u, gl * c, 1.0)),
        reverse=True, axis=0)
    return jnp.where(u, a_adv, 0.0)


def gae_rows(reward, value, valid, link, value_end, *, gamma, lam, impl="scan", unroll=1):
    """:func:`gae_time_major` for row-major ``[R, P]`` inputs; returns ``[R, P]`` float32."""
    t = lambda x: jnp.swapaxes(x, 0, 1)
    return t(gae_time_major(t(reward), t(value), t(valid), t(link), value_end,
                            gamma=gamma, lam=lam, impl=impl, unroll=unroll))


def _gae_blocked(
    reward: jax.Array,
    value: jax.Array,
    length: jax.Array,
    chunk_link: jax.Array,
    value_end: jax.Array,
    to_chunks: Callable[[jax.Array], jax.Array],
    from_chunks: Callable[[jax.Array], jax.Array],
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
) -> jax.Array:
    """Blocked solve of the recurrence, one block per response
    (docs/algorithm.md#one-recurrence-for-both).

    Args:
      reward, value: ``[S, B, N, K]`` float32 (entries off valid points are ignored).
      length: ``[S, B, N]`` int32, K_{s,b,i}; valid points are ``k < length``.
      chunk_link: ``[S, B, N]`` float32, c at the response's last token.
      value_end: ``[R]`` float32, V of the virtual end point of each sequence.
      to_chunks: ``[S, B, N]`` -> ``[C, R]``, responses in sequence order (time-major).
      from_chunks: inverse of ``to_chunks``.

    Inside a response, ``A_k = delta_k + gl * A_{k+1}`` with ``delta_k = r_k + gamma V_{k+1} - V_k``
    (the last token: ``r + gamma c V_next - V`` and ``A_next`` scaled by ``c``), so
    ``A_0 = sum_k gl^k delta_k + gl^K c A_next``: a short scan over responses gives every
    response's ``A_next``; folding ``gl c A_next`` into the last token's delta, one discounted
    suffix sum over the token axis (:func:`discounted_suffix_sum`; no mask needed: padding
    sits after each response and has delta = 0) fills in the rest.

    Returns:
      ``[S, B, N, K]`` float32 advantages, zero off valid points.
    """
    f32 = jnp.float32
    shape = reward.shape
    gamma = jnp.asarray(gamma, f32)
    gl = gamma * jnp.asarray(lam, f32)
    k = jnp.arange(shape[-1], dtype=jnp.int32)
    valid = k < length[..., None]
    has = length > 0

    # V of the next response's first token (or V_end), per response, in sequence order.
    def next_value(carry, x):
        h, v0 = x
        return jnp.where(h, v0, carry), carry

    # Few chunks (steps x agents): unrolled, a while loop's per-iteration cost dominates here.
    _, v_after = lax.scan(next_value, value_end, (to_chunks(has), to_chunks(value[..., 0])),
                          reverse=True, unroll=True)
    v_after = from_chunks(v_after)                                      # [S, B, N]

    is_last = k == (length - 1)[..., None]
    v_shift = jnp.concatenate([value[..., 1:], jnp.zeros_like(value[..., :1])], axis=-1)
    v_next = jnp.where(is_last, (chunk_link * v_after)[..., None], v_shift)
    delta = jnp.where(valid, reward + gamma * v_next - value, 0.0)

    # A at each response's first token = head + gain * A_next (A_next: next response's A_0).
    head = jnp.sum(delta * jnp.power(gl, k.astype(f32)), axis=-1)      # sum_k gl^k delta_k
    gain = chunk_link * jnp.power(gl, length.astype(f32))

    def next_adv(carry, x):
        h, a0, g0 = x
        return jnp.where(h, a0 + g0 * carry, carry), carry

    _, a_after = lax.scan(next_adv, jnp.zeros_like(value_end),
                          (to_chunks(has), to_chunks(head), to_chunks(gain)), reverse=True, unroll=True)
    # Fold the link into the last token's delta; then A_k = delta_k + gl * A_{k+1} with A = 0
    # after the response: padding (delta = 0, at the end of each response) keeps A at 0.
    link_term = (gl * chunk_link * from_chunks(a_after))[..., None]
    delta = delta + jnp.where(is_last, link_term, 0.0)

    return discounted_suffix_sum(delta, gl)


def _triangular_powers(n: int, g: jax.Array, stride: int = 1, offset: int = 0) -> jax.Array:
    """``[n, n]`` float32: ``M[i, j] = g^e`` with ``e = stride * (j - i) - offset`` where
    ``e >= 0``, 0 elsewhere (an upper triangle of discount powers; never a negative power)."""
    d = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]
    e = stride * d - offset
    return jnp.where(e >= 0, jnp.power(g, jnp.maximum(e, 0).astype(jnp.float32)), 0.0)


def discounted_suffix_sum(x: jax.Array, g: float | jax.Array, block: int = 16) -> jax.Array:
    """``y_k = sum_{j >= k} g^(j - k) x_j`` along the last axis (``y_k = x_k + g y_{k+1}``).

    Two-level blocked form without a sequential loop: the axis is cut into blocks of ``block``;
    inside a block ``y`` is one small upper-triangular matmul, ``[block, block]``; across blocks
    the suffix of the block heads is a second one, ``[n_blocks, n_blocks]``; every entry then adds
    ``g^(block - i)`` times the suffix at the start of the next block. No negative powers (no
    overflow for small ``g``). On the CPU this beats a ``lax.scan`` over the axis (one short
    vector per iteration) and keeps the natural layout (no transposes).

    Args:
      x: ``[..., K]`` float32.
      g: the per-position factor (``gamma * lam`` for GAE).
      block: block length (16 measured best on 2-core x86 for K = 512).

    Returns:
      ``[..., K]`` float32.
    """
    f32 = jnp.float32
    g = jnp.asarray(g, f32)
    k = x.shape[-1]
    nb = -(-k // block)
    pad = nb * block - k
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    xb = x.reshape(x.shape[:-1] + (nb, block))
    hi = lax.Precision.HIGHEST
    local = jnp.einsum("...bj,ij->...bi", xb, _triangular_powers(block, g), precision=hi)
    # Suffix at the start of block b + 1: sum_{c > b} g^(block (c - b - 1)) head_c.
    later = _triangular_powers(nb, g, stride=block, offset=block)
    nxt = jnp.einsum("...c,bc->...b", local[..., 0], later, precision=hi)
    tail = jnp.power(g, (block - jnp.arange(block)).astype(f32))
    y = local + tail * nxt[..., None]
    y = y.reshape(x.shape)
    return y[..., :k] if pad else y


# ----------------------------------------------------------------------------------------------
# Masks, link factors, bootstrap.


def _last_valid(valid: jax.Array) -> jax.Array:
    """``[..., K]`` bool -> ``[..., K]`` bool: True at the last True entry along the last axis."""
    k = jnp.arange(valid.shape[-1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, k, -1), axis=-1, keepdims=True)
    return jnp.logical_and(k == last, valid)


def _step_cuts(has_valid: jax.Array, terminal: jax.Array) -> jax.Array:
    """Whether the link leaving step s crosses a terminal step.

    The last valid point of step s links to the first valid point of the next step s' > s that
    has one (or to the end of the row); the link is cut iff any of steps s .. s'-1 is terminal
    (whole-episode rows: only a terminal s itself; the extra case is a terminal step without
    any valid point, after which nothing may chain across).

    Args:
      has_valid: ``[S, ...]`` bool, the step has a valid point (per row, or per row and agent).
      terminal: ``[S, ...]`` bool (broadcastable to ``has_valid``).

    Returns:
      ``[S, ...]`` bool. S is static and small: a Python loop over steps.
    """
    terminal = jnp.broadcast_to(terminal, has_valid.shape)
    cuts = [terminal[-1]]
    for s in range(has_valid.shape[0] - 2, -1, -1):
        cuts.append(jnp.logical_or(
            terminal[s], jnp.logical_and(jnp.logical_not(has_valid[s + 1]), cuts[-1])))
    return jnp.stack(cuts[::-1], axis=0)


def _marft_chunk_links(has: jax.Array, terminal: jax.Array, reference_semantics: bool) -> jax.Array:
    """Link factor at each response's last token, chained backup.

    Args:
      has: ``[S, B, N]`` bool, the agent produced >= 1 valid point at step s.
      terminal: ``[S, B]`` bool, already masked by ``step_mask``.

    Returns:
      ``[S, B, N]`` float32: 0 for the last acting agent of a step whose link crosses a
      terminal step; with ``reference_semantics`` also 0 for agents ``i < N-1`` of a step
      ``s >= 1`` that follows a terminal step (G1's intra-step mask, quirk #10); 1 elsewhere.
    """
    cut = jnp.logical_and(_last_valid(has), _step_cuts(jnp.any(has, axis=-1), terminal)[..., None])
    if reference_semantics:
        prev_terminal = jnp.concatenate([jnp.zeros_like(terminal[:1]), terminal[:-1]], axis=0)
        not_last_agent = jnp.arange(has.shape[2]) < has.shape[2] - 1
        quirk = jnp.logical_and(prev_terminal[:, :, None], not_last_agent[None, None, :])
        cut = jnp.logical_or(cut, jnp.logical_and(has, quirk))
    return jnp.where(cut, 0.0, 1.0).astype(jnp.float32)


def _check_inputs(reward, value, dp_mask, step_mask, terminal, truncated, level):
    axes = layout.TOKEN_AXES if level == "token" else layout.ACTION_AXES
    dims = layout.assert_layout(value, "value", axes, dtype=jnp.floating)
    layout.assert_layout(reward, "reward", axes, sizes=dims, dtype=jnp.floating)
    layout.assert_layout(dp_mask, "dp_mask", axes, sizes=dims, dtype=bool)
    for name, x in (("step_mask", step_mask), ("terminal", terminal), ("truncated", truncated)):
        layout.assert_layout(x, name, layout.STEP_AXES, sizes=dims, dtype=bool)
    return dims


class _Points(NamedTuple):
    """Token-shaped inputs of an XLA backup (action level gets a K = 1 axis)."""

    r: jax.Array            # [S, B, N, K] float32, garbage off valid points
    v: jax.Array            # [S, B, N, K] float32, garbage off valid points
    valid: jax.Array        # [S, B, N, K] bool, dp_mask & step_mask
    length: jax.Array       # [S, B, N] int32, valid points per response
    has: jax.Array          # [S, B, N] bool, the response has >= 1 valid point
    step_mask: jax.Array    # [S, B] bool
    terminal: jax.Array     # [S, B] bool, masked by step_mask


def _tokens(x: jax.Array) -> jax.Array:
    """``[S, B, N]`` (action level) -> ``[S, B, N, 1]``; token-level arrays unchanged."""
    return x[..., None] if x.ndim == 3 else x


def _prepare(reward, value, dp_mask, step_mask, terminal) -> _Points:
    """Float32 token-shaped copies, masked terminal and per-response lengths (XLA impls)."""
    step_mask = step_mask.astype(bool)
    terminal = jnp.logical_and(terminal.astype(bool), step_mask)
    dp = _tokens(dp_mask.astype(bool))
    # Not masked here: every implementation selects with the validity mask where it reads
    # them (pads may hold garbage, even NaN).
    r = _tokens(reward.astype(jnp.float32))
    v = _tokens(value.astype(jnp.float32))
    valid = jnp.logical_and(dp, step_mask[:, :, None, None])
    length = jnp.sum(valid, axis=-1, dtype=jnp.int32)               # [S, B, N] valid points
    return _Points(r, v, valid, length, length > 0, step_mask, terminal)


def _row_end(step_mask, terminal, truncated, reference_semantics):
    """Per row: whether V_boot is used at the virtual end point. ``[B]`` bool."""
    final = layout.last_played_onehot(step_mask)                       # [S, B]
    term_last = layout.at_step(terminal, final)
    if reference_semantics:
        return jnp.logical_and(jnp.any(step_mask, axis=0), jnp.logical_not(term_last))
    trunc_last = layout.at_step(truncated, final)
    return jnp.logical_and(trunc_last, jnp.logical_not(term_last))


def _native(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, *, independent,
            reference_semantics, gamma, lam) -> Backup:
    """``impl="native"``: the whole backup as one fused call (token-shaped, then reshaped)."""
    adv, ret = native.backup(_tokens(reward), _tokens(value), _tokens(dp_mask), step_mask,
                             terminal, truncated, v_boot, gamma=gamma, lam=lam,
                             independent=independent, reference_semantics=reference_semantics)
    return Backup(adv.reshape(value.shape), ret.reshape(value.shape))


def _solve(pts: _Points, chunk_link, v_end, *, independent, gamma, lam, impl, unroll):
    """An XLA implementation (``impl`` resolved). Returns token-shaped ``[S, B, N, K]`` (adv, ret)."""
    r, v, valid, length = pts.r, pts.v, pts.valid, pts.length
    s_, _, n_, k_ = r.shape
    if impl == "blocked":
        if independent:
            to_c = lambda x: layout.time_major_agent_sequences(x, "action")
            from_c = lambda x: layout.from_time_major_agent_sequences(x, (s_, n_))
        else:
            to_c = lambda x: layout.time_major_decisions(x, "action")
            from_c = lambda x: layout.from_time_major_decisions(x, (s_, n_))
        adv = _gae_blocked(r, v, length, chunk_link, v_end, to_c, from_c, gamma=gamma, lam=lam)
        return adv, jnp.where(valid, adv + v, 0.0)
    link = jnp.where(_last_valid(valid), chunk_link[..., None], 1.0)
    if independent:
        tm = lambda x: layout.time_major_agent_sequences(x, "token")
        back = lambda x: layout.from_time_major_agent_sequences(x, (s_, n_, k_))
    else:
        tm = lambda x: layout.time_major_decisions(x, "token")
        back = lambda x: layout.from_time_major_decisions(x, (s_, n_, k_))
    adv = back(gae_time_major(tm(r), tm(v), tm(valid), tm(link), v_end,
                              gamma=gamma, lam=lam, impl=impl, unroll=unroll))
    return adv, jnp.where(valid, adv + v, 0.0)


# ----------------------------------------------------------------------------------------------
# Link tables (team graphs): a response's last point links to a successor chunk (Topology.links).


class LinkIndex(NamedTuple):
    """Host-side index arrays of a :class:`~marft_jax.rl.topology.LinkTable` (static per run).

    Chunks ``c = s * N + i``, ``C = S * N`` the row's virtual end. ``order`` lists the chunks
    so that every chunk comes after its successor and its skip target (the reverse pass's
    visiting order).
    """

    order: np.ndarray        # [C] int32
    succ: np.ndarray         # [C] int32 in [0, C]
    skip: np.ndarray         # [C] int32 in [0, C]
    succ_crosses: np.ndarray  # [C] bool
    skip_crosses: np.ndarray  # [C] bool
    num_steps: int
    num_agents: int


def link_index(links: LinkTable) -> LinkIndex:
    """The visiting order and flat index arrays of ``links`` (raises on a cycle or a bad index)."""
    S, N = links.num_steps, links.num_agents
    C = S * N
    succ = np.asarray(links.succ, np.int64).reshape(C)
    skip = np.asarray(links.skip, np.int64).reshape(C)
    for name, t in (("succ", succ), ("skip", skip)):
        bad = np.flatnonzero((t < 0) | (t > C) | (t == np.arange(C)))
        if bad.size:
            raise ValueError(f"link table: {name}[{int(bad[0])}] = {int(t[bad[0]])} is not another chunk "
                             f"or the end {C}")
    order: list[int] = []
    state = np.zeros(C, np.int8)                       # 0 new, 1 on the stack, 2 placed
    for root in range(C - 1, -1, -1):
        stack = [root]
        while stack:
            d = stack[-1]
            if state[d] == 0:
                state[d] = 1
            deps = [int(t) for t in (succ[d], skip[d]) if t < C and state[t] != 2]
            if any(state[t] == 1 for t in deps):
                raise ValueError(f"link table: chunk {d} links back into a cycle")
            if deps:
                stack.append(deps[0])
            else:
                state[d] = 2
                order.append(d)
                stack.pop()
    return LinkIndex(np.asarray(order, np.int32), succ.astype(np.int32), skip.astype(np.int32),
                    np.asarray(links.succ_crosses, bool).reshape(C),
                    np.asarray(links.skip_crosses, bool).reshape(C), S, N)


def chunk_recurrence(a: jax.Array, b: jax.Array, nxt: jax.Array, end: jax.Array, order: np.ndarray,
                     *, method: str = "scan") -> jax.Array:
    """Solves ``x_c = a_c + b_c * x_{nxt_c}`` over the chunks of a link table, ``x_C = end``.

    Args:
      a, b: ``[C, R]`` float32 (chunk-major, ``layout.time_major_decisions`` at action level).
      nxt: ``[C, R]`` int32 pointers into ``[0, C]``; every pointer leads to a chunk visited
        earlier in ``order`` (or to the end ``C``), so the pointers form a forest rooted at C.
      end: ``[R]`` float32, x at the virtual end.
      order: ``[C]`` static visiting order (:func:`link_index`).
      method: ``"scan"`` (one ``lax.scan`` over ``order``, unrolled: C is small) or ``"jump"``
        (pointer jumping: ``ceil(log2 C)`` rounds of gathers, log depth).

    Returns:
      ``[C + 1, R]`` float32, x per chunk, then the end.
    """
    C, R = a.shape
    if method == "scan":
        cols = jnp.arange(R)
        buf = jnp.zeros((C + 1, R), jnp.float32).at[C].set(end)

        def visit(buf, xs):
            d, a_d, b_d, n_d = xs
            return lax.dynamic_update_index_in_dim(buf, a_d + b_d * buf[n_d, cols], d, 0), None

        o = jnp.asarray(order)
        buf, _ = lax.scan(visit, buf, (o, a[o], b[o], nxt[o]), unroll=True)
        return buf
    if method != "jump":
        raise ValueError(f"chunk_recurrence: method must be 'scan' or 'jump', got {method!r}")
    # x_c = A_c + B_c x_{P_c}; each round substitutes x_{P_c}, doubling the hops (C -> C absorbs).
    A = jnp.concatenate([a, end[None]], axis=0)
    Bf = jnp.concatenate([b, jnp.zeros((1, R), jnp.float32)], axis=0)
    P = jnp.concatenate([nxt, jnp.full((1, R), C, nxt.dtype)], axis=0)
    take = lambda x: jnp.take_along_axis(x, P, axis=0)
    for _ in range(max(1, C.bit_length())):            # static: 2^rounds > C >= longest path
        A, Bf, P = A + Bf * take(A), Bf * take(Bf), take(P)
    return A + Bf * take(A)


def link_targets(has: jax.Array, linked: LinkIndex) -> tuple[jax.Array, jax.Array]:
    """Per-chunk pointers of the resolved recurrence: ``[C, B]`` int32 ``where(has, succ, skip)``
    and the chunk-major ``has`` (``[S, B, N]`` bool in)."""
    has_c = layout.time_major_decisions(has, "action")                 # [C, B]
    nxt = jnp.where(has_c, jnp.asarray(linked.succ)[:, None], jnp.asarray(linked.skip)[:, None])
    return nxt.astype(jnp.int32), has_c


def _solve_linked(pts: _Points, linked: LinkIndex, v_end, *, gamma, lam, impl):
    """A table backup (``impl`` an XLA one). Returns token-shaped ``[S, B, N, K]`` (adv, ret).

    Per chunk the link target is ``succ`` resolved through ``skip`` past chunks without valid
    points (to the end ``C`` at worst); the link is cut (factor 0) iff it, or a skip on the
    way, leaves a terminal step. Four phases, none with a loop over tokens:

    1. chunk recurrences (:func:`chunk_recurrence`): the first valid value ``V_in`` and the
       "not cut" factor ``keep_in`` seen at every chunk (the end: ``v_end``, 1);
    2. inside each response, with the successor's advantage set to 0, the advantages ``A0``
       (``scan``/``associative``: :func:`gae_rows` over the token axis; ``blocked``: closed
       form) and their gain ``G_k = c * (gamma lam)^(valid points from k on)`` on that
       advantage;
    3. the advantage at each chunk's first valid point, ``A_in = A0_first + G_first *
       A_in[succ]``, as a chunk recurrence;
    4. ``A = A0 + G * A_in[succ]`` on every valid point.
    """
    f32 = jnp.float32
    r, v, valid, length, has = pts.r, pts.v, pts.valid, pts.length, pts.has
    s_, b_, n_, k_ = r.shape
    gamma = jnp.asarray(gamma, f32)
    gl = gamma * jnp.asarray(lam, f32)
    method = "jump" if impl == "associative" else "scan"
    to_c = lambda x: layout.time_major_decisions(x, "action")          # [S, B, N] -> [C, B]
    from_c = lambda x: layout.from_time_major_decisions(x, (s_, n_))  # [C, B] -> [S, B, N]
    succ = jnp.asarray(linked.succ)
    term_c = to_c(jnp.broadcast_to(pts.terminal[:, :, None], has.shape))
    nxt, has_c = link_targets(has, linked)

    first = jnp.argmax(valid, axis=-1)[..., None]                       # [S, B, N, 1]
    v_first = to_c(jnp.where(has, jnp.take_along_axis(v, first, axis=-1)[..., 0], 0.0))
    v_in = chunk_recurrence(v_first, jnp.where(has_c, 0.0, 1.0), nxt, v_end, linked.order, method=method)
    skip_keep = 1.0 - jnp.logical_and(jnp.asarray(linked.skip_crosses)[:, None], term_c).astype(f32)
    keep_in = chunk_recurrence(jnp.where(has_c, 1.0, 0.0), jnp.where(has_c, 0.0, skip_keep), nxt,
                               jnp.ones_like(v_end), linked.order, method=method)
    succ_keep = 1.0 - jnp.logical_and(jnp.asarray(linked.succ_crosses)[:, None], term_c).astype(f32)
    chunk_link = from_c(succ_keep * keep_in[succ])                      # [S, B, N]
    v_next = from_c(v_in[succ])                                         # [S, B, N]

    if impl == "blocked":
        k = jnp.arange(k_, dtype=jnp.int32)
        is_last = k == (length - 1)[..., None]
        v_shift = jnp.concatenate([v[..., 1:], jnp.zeros_like(v[..., :1])], axis=-1)
        nv = jnp.where(is_last, (chunk_link * v_next)[..., None], v_shift)
        a0 = discounted_suffix_sum(jnp.where(valid, r + gamma * nv - v, 0.0), gl)
    else:
        link = jnp.where(_last_valid(valid), chunk_link[..., None], 1.0)
        rows = lambda x: x.reshape(-1, k_)
        a0 = gae_rows(rows(r), rows(v), rows(valid), rows(link), v_next.reshape(-1),
                      gamma=gamma, lam=lam, impl=impl).reshape(r.shape)
    ahead = length[..., None] - jnp.cumsum(valid, axis=-1, dtype=jnp.int32) + valid   # points k.. end
    gain = jnp.where(valid, chunk_link[..., None] * jnp.power(gl, ahead.astype(f32)), 0.0)

    a0_first = to_c(jnp.where(has, jnp.take_along_axis(a0, first, axis=-1)[..., 0], 0.0))
    g_first = to_c(jnp.where(has, chunk_link * jnp.power(gl, length.astype(f32)), 0.0))
    a_in = chunk_recurrence(a0_first, jnp.where(has_c, g_first, 1.0), nxt, jnp.zeros_like(v_end),
                            linked.order, method=method)
    a_next = from_c(a_in[succ])                                          # [S, B, N]
    adv = jnp.where(valid, a0 + gain * a_next[..., None], 0.0)
    return adv, jnp.where(valid, adv + v, 0.0)


def _native_linked(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, linked: LinkIndex, *,
                   gamma, lam) -> Backup:
    """``impl="native"`` with a link table (token-shaped, then reshaped)."""
    adv, ret = native.backup_linked(_tokens(reward), _tokens(value), _tokens(dp_mask), step_mask,
                                    terminal, truncated, v_boot, native_table(linked), gamma=gamma, lam=lam)
    return Backup(adv.reshape(value.shape), ret.reshape(value.shape))


def native_table(linked: LinkIndex) -> np.ndarray:
    """``[4, C]`` int32 for the native kernel: visiting order, successor, skip target, and the
    crossing flags (bit 0: the successor link leaves the step, bit 1: the skip link does)."""
    flags = linked.succ_crosses.astype(np.int32) | (linked.skip_crosses.astype(np.int32) << 1)
    return np.stack([linked.order, linked.succ, linked.skip, flags]).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# MARFT backups (chained: token -> agent -> step).


def marft_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    impl: str = "auto",
    reference_semantics: bool = False,
    unroll: int = 1,
    links: LinkTable | None = None,
) -> Backup:
    """MARFT backup at action or token level (level read from the rank of ``value``), chained
    in execution order or along a team graph's link table.

    Args:
      reward: ``[S, B, N]`` (action) or ``[S, B, N, K]`` (token) float, placed rewards
        (``rewards.place_reward``); entries off valid points are ignored.
      value: same shape, float, critic value per decision point.
      dp_mask: same shape, bool, valid decision points (``layout.action_decision_mask`` /
        ``layout.token_decision_mask``).
      step_mask: ``[S, B]`` bool, step played (a prefix per row).
      terminal: ``[S, B]`` bool, episode ended at s by termination (no bootstrap).
      truncated: ``[S, B]`` bool, episode ended at s by a step cap (bootstrap from ``v_boot``).
      v_boot: ``[B]`` float, critic value at agent 0's context of step s*+1 (``[B, N]``, each
        agent's value at its own next-step context, with a ``kind="per_agent"`` table).
      gamma, lam: discount and GAE lambda (action default 0.99 / 0.95, token 1 / 1).
      impl: ``"auto"`` | ``"scan"`` | ``"associative"`` | ``"blocked"`` | ``"native"``
        (module doc).
      reference_semantics: reproduce G1's masks (quirk #10) and bootstrap (module doc).
      unroll: ``lax.scan`` unroll (``impl="scan"``, chained links).
      links: the team graph's link table for ``S`` steps and ``N`` agents
        (:meth:`~marft_jax.rl.topology.Topology.links`, static). None or ``kind="chain"``: the
        chained recurrence above (exactly the same program). ``kind="table"`` (e.g.
        ``team.layer_links=layer``): a response's last valid point links to the first valid
        point of its successor chunk, resolved through the skip targets past responses
        without valid points; the link is cut iff it or a skip on the way leaves a terminal
        step; several responses may share a successor (:func:`_solve_linked`). Bootstrap as
        above; ``reference_semantics`` applies to the chain only. ``kind="per_agent"`` (the
        independent graph): agent i's last valid point of step s links to agent i's first
        valid point of a later step (cut after a terminal step), each agent's sequence ending
        at its own ``v_boot[:, i]`` (:func:`independent_gae`).

    Returns:
      :class:`Backup` ``(advantages, returns)``, float32, shaped like ``value``, zero on invalid
      points.
    """
    level = layout.level_of(value)
    dims = _check_inputs(reward, value, dp_mask, step_mask, terminal, truncated, level)
    impl = resolve_impl(impl)
    if links is not None and (links.num_steps, links.num_agents) != (dims[layout.STEP], dims[layout.AGENT]):
        raise ValueError(f"the link table is for {links.num_steps} step(s) x {links.num_agents} agent(s), the "
                         f"backup's inputs are {dims[layout.STEP]} x {dims[layout.AGENT]}")
    if links is not None and links.kind == "per_agent":
        return _per_agent_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, links, dims,
                              gamma=gamma, lam=lam, impl=impl, unroll=unroll,
                              reference_semantics=reference_semantics)
    layout.assert_layout(v_boot, "v_boot", (layout.BATCH,), sizes=dims)
    if links is not None and links.kind != "chain":
        return _marft_gae_linked(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, links,
                                 gamma=gamma, lam=lam, impl=impl,
                                 reference_semantics=reference_semantics)
    if impl == "native":
        return _native(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                       independent=False, reference_semantics=reference_semantics,
                       gamma=gamma, lam=lam)
    pts = _prepare(reward, value, dp_mask, step_mask, terminal)
    chunk_link = _marft_chunk_links(pts.has, pts.terminal, reference_semantics)
    use_boot = _row_end(pts.step_mask, pts.terminal, truncated.astype(bool), reference_semantics)
    v_end = jnp.where(use_boot, v_boot.astype(jnp.float32), 0.0)
    adv, ret = _solve(pts, chunk_link, v_end, independent=False,
                      gamma=gamma, lam=lam, impl=impl, unroll=unroll)
    return Backup(adv.reshape(value.shape), ret.reshape(value.shape))


def _marft_gae_linked(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, links: LinkTable, *,
                      gamma, lam, impl, reference_semantics) -> Backup:
    """:func:`marft_gae` along a ``kind="table"`` link table (``impl`` resolved)."""
    if links.kind != "table":
        raise ValueError(f"unknown link table kind {links.kind!r}")
    if reference_semantics:
        raise ValueError("reference_semantics (G1's chained masks) applies to the chain links only, not to "
                         "a link table (team.layer_links=layer)")
    linked = link_index(links)
    if impl == "native":
        return _native_linked(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, linked,
                              gamma=gamma, lam=lam)
    pts = _prepare(reward, value, dp_mask, step_mask, terminal)
    use_boot = _row_end(pts.step_mask, pts.terminal, truncated.astype(bool), False)
    v_end = jnp.where(use_boot, v_boot.astype(jnp.float32), 0.0)
    adv, ret = _solve_linked(pts, linked, v_end, gamma=gamma, lam=lam, impl=impl)
    return Backup(adv.reshape(value.shape), ret.reshape(value.shape))


def action_level_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array = 0.99,
    lam: float | jax.Array = 0.95,
    impl: str = "auto",
    reference_semantics: bool = False,
) -> Backup:
    """MARFT-A backup (docs/algorithm.md#action-level-backup). ``reward``, ``value``, ``dp_mask``:
    ``[S, B, N]``; see :func:`marft_gae`."""
    if layout.level_of(value) != "action":
        raise AssertionError(f"action_level_gae: value must be [S, B, N], got {value.shape}")
    return marft_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                     gamma=gamma, lam=lam, impl=impl, reference_semantics=reference_semantics)


def token_level_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 1.0,
    impl: str = "auto",
    reference_semantics: bool = False,
) -> Backup:
    """MARFT-T backup (docs/algorithm.md#token-level-backup). ``reward``, ``value``, ``dp_mask``:
    ``[S, B, N, K]``; see :func:`marft_gae`."""
    if layout.level_of(value) != "token":
        raise AssertionError(f"token_level_gae: value must be [S, B, N, K], got {value.shape}")
    return marft_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                     gamma=gamma, lam=lam, impl=impl, reference_semantics=reference_semantics)


# ----------------------------------------------------------------------------------------------
# Independent PPO (docs/algorithm.md#independent-learners): no chaining, agent i at step s links
# to agent i at step s+1.


def independent_gae(
    reward: jax.Array,
    value: jax.Array,
    dp_mask: jax.Array,
    step_mask: jax.Array,
    terminal: jax.Array,
    truncated: jax.Array,
    v_boot: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    impl: str = "auto",
    unroll: int = 1,
) -> Backup:
    """Independent-PPO backup: each agent's own sequence of decision points over steps
    (:func:`marft_gae` along the independent graph's table, ``topology.per_agent_links``).

    Agent i's last valid point of step s links to agent i's first valid point of a later step
    (factor ``e_s = 1 - terminal_s``), never to another agent. Terminal/truncated semantics as
    in :func:`marft_gae` (``reference_semantics=False``), per agent.

    Args:
      reward, value, dp_mask: ``[S, B, N]`` (action) or ``[S, B, N, K]`` (token); per-agent
        rewards placed on each agent's own points (``place_reward(..., reward_to="all")``).
      step_mask, terminal, truncated: ``[S, B]`` bool (the episode is shared by all agents).
      v_boot: ``[B, N]`` float, each agent's bootstrap value at its own next-step context.
      impl: as in :func:`marft_gae`.

    Returns:
      :class:`Backup` in the input layout, float32, zero on invalid points.
    """
    links = per_agent_links(value.shape[layout.STEP_AXIS], value.shape[layout.AGENT_AXIS])
    return marft_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, gamma=gamma, lam=lam,
                     impl=impl, unroll=unroll, links=links)


def _per_agent_gae(reward, value, dp_mask, step_mask, terminal, truncated, v_boot, links: LinkTable, dims, *,
                   gamma, lam, impl, unroll, reference_semantics) -> Backup:
    """:func:`marft_gae` along a ``kind="per_agent"`` table (``impl`` resolved): each agent's own
    sequence of decision points over the steps, ending at its own bootstrap value."""
    if links != per_agent_links(links.num_steps, links.num_agents):
        raise ValueError("a kind='per_agent' link table must link each agent to itself at the next step "
                         "(topology.per_agent_links)")
    if reference_semantics:
        raise ValueError("reference_semantics (G1's chained masks) applies to the chain links only, not to "
                         "the independent graph's per-agent links")
    if v_boot.ndim != 2:
        raise ValueError(f"a per-agent link table (the independent graph) takes v_boot [B, N], each agent's "
                         f"own bootstrap value; got shape {tuple(v_boot.shape)}")
    layout.assert_layout(v_boot, "v_boot", (layout.BATCH, layout.AGENT), sizes=dims)
    if impl == "native":
        return _native(reward, value, dp_mask, step_mask, terminal, truncated,
                       layout.flatten_agents(v_boot), independent=True, reference_semantics=False,
                       gamma=gamma, lam=lam)
    pts = _prepare(reward, value, dp_mask, step_mask, terminal)
    has, terminal = pts.has, pts.terminal                               # [S, B, N], [S, B]
    cut = jnp.logical_and(has, _step_cuts(has, terminal[:, :, None]))   # per agent sequence
    chunk_link = jnp.where(cut, 0.0, 1.0).astype(jnp.float32)
    use_boot = _row_end(pts.step_mask, terminal, truncated.astype(bool), False)      # [B]
    v_end = layout.flatten_agents(jnp.where(use_boot[:, None], v_boot.astype(jnp.float32), 0.0))   # [B*N]
    adv, ret = _solve(pts, chunk_link, v_end, independent=True,
                      gamma=gamma, lam=lam, impl=impl, unroll=unroll)
    return Backup(adv.reshape(value.shape), ret.reshape(value.shape))
