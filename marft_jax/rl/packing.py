"""Sequence packing: several (context ‖ action) sequences per row, so work follows valid tokens.

A trajectory stores every (step, row, agent) context left-padded to one bucket ``L`` and every
action right-padded to ``K``; a forward over ``[L + K]`` per sequence spends most of its work
on padding when contexts vary (the reference workload: contexts of 130-830 tokens, bucket 1024,
3.4x the valid tokens). Here the *valid* tokens of each sequence are laid end to end in rows of
``T`` slots (first-fit decreasing), with

* ``segment_ids [R, T]`` int32: ``j + 1`` on the tokens of the group's sequence ``j``, 0 on padding; the decoder's attention mask is block-diagonal causal over equal ids
  (``decoder.forward(..., segment_ids=...)``);
* ``positions [R, T]`` int32: RoPE positions restarting at 0 in every sequence (exactly the
  positions the padded layout gives, since those skip left padding);
* ``gather [n, P]`` int32: for sequence ``n``, the flat index (into the ``R * T`` slots of its
  group) of the hidden state at each of its ``P`` read positions. Actions read ``P = K``
  positions ``c - 1 + k`` (the one predicting action token ``k``, ``c`` = valid context tokens);
  action-level critic features read ``P = 1`` at ``c - 1``. Positions past a sequence's end are
  clamped into its row (they are masked downstream, as the padded layout's are).

Packing is host-side NumPy over a few hundred sequences (data preparation, not a hot loop).
Shapes are static per compiled program, so :class:`ShapePolicy` reuses a shape already compiled
whenever it fits within a padding allowance, and grows otherwise (a handful of programs per run).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import numpy as np

from marft_jax.models.decoder import PackedRows

ROW_ALIGN = 32  # packed row lengths are multiples of this


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each sequence of one group went: ``row [n]``, ``start [n]`` (slot), ``rows`` used."""

    row: np.ndarray
    start: np.ndarray
    rows: int


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> Placement:
    """Place sequences of ``lengths`` into rows of ``row_len`` slots, longest first.

    Empty sequences (length 0) take no slot (row 0, start 0). Raises ``ValueError`` when a
    sequence is longer than a row.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > row_len:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a packed row of {row_len}")
    row = np.zeros(lengths.shape, np.int32)
    start = np.zeros(lengths.shape, np.int32)
    free: list[int] = []
    for j in np.argsort(-lengths, kind="stable"):
        n = int(lengths[j])
        if n == 0:
            continue
        for r, f in enumerate(free):
            if f >= n:
                break
        else:
            r = len(free)
            free.append(row_len)
        row[j], start[j] = r, row_len - free[r]
        free[r] -= n
    return Placement(row=row, start=start, rows=len(free))


def align(n: int, multiple: int = ROW_ALIGN) -> int:
    """``n`` rounded up to a multiple (at least one multiple)."""
    return max(multiple, -(-int(n) // multiple) * multiple)


@dataclasses.dataclass
class ShapePolicy:
    """Chooses the static ``(rows, row_len)`` of packed groups and remembers what compiled.

    For a set of groups (sequence-length lists, all packed to one shape), it tries row lengths
    ``align(longest * f)`` for ``f`` in ``row_len_factors`` and ``align(total / r)`` for
    ``r = 1 .. max_split`` rows (``total``: the largest group's tokens; only lengths that hold the
    longest sequence) and takes the cheapest by :meth:`cost` (``rows`` = the most rows any group
    needs): the slots ``rows * row_len`` (the linear layers' work) plus the dense attention of
    each row, ``rows * row_len² * attention_cost`` (``attention_cost``: one query-key pair's
    FLOPs over one token's linear FLOPs, :func:`attention_cost_of`; without it one long row
    would always win). A shape seen before is reused when it fits and costs at most
    ``reuse_slack`` times the best fresh shape; otherwise the fresh shape is adopted (one more
    compile). ``minimum_row_len`` keeps tiny batches from compiling many small shapes.
    """

    reuse_slack: float = 1.25
    row_len_factors: tuple[float, ...] = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
    max_split: int = 8
    minimum_row_len: int = ROW_ALIGN
    attention_cost: float = 1.0 / 3000.0     # SmolLM2-135M; see attention_cost_of
    seen: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def cost(self, rows: int, row_len: int) -> float:
        """Relative work of a ``[rows, row_len]`` packed forward (linear layers + dense attention)."""
        return rows * row_len * (1.0 + row_len * self.attention_cost)

    def choose(self, groups: Sequence[Sequence[int]]) -> tuple[int, int]:
        """``(rows, row_len)`` for packing every group of sequence lengths."""
        longest = max([max(g, default=0) for g in groups] + [1])
        base = max(align(longest), self.minimum_row_len)

        def rows_needed(row_len: int) -> int:
            return max(1, max(first_fit_decreasing(g, row_len).rows for g in groups))

        total = max([sum(g) for g in groups] + [1])
        candidates = {align(base * f) for f in self.row_len_factors}
        candidates |= {max(base, align(-(-total // r))) for r in range(1, self.max_split + 1)}
        best_cost, best_t = min((self.cost(rows_needed(t), t), t) for t in candidates)
        fits = [(self.cost(r, t), r, t) for r, t in self.seen if t >= longest and r >= rows_needed(t)]
        if fits:
            c, r, t = min(fits)
            if c <= self.reuse_slack * best_cost:
                return r, t
        shape = (rows_needed(best_t), best_t)
        self.seen.append(shape)
        return shape


def attention_cost_of(cfg) -> float:
    """FLOPs of one query-key pair (scores + weighted values, every layer) over one token's
    FLOPs in the linear layers (projections and MLP, every layer) for a ``ModelConfig``."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return (4.0 * cfg.q_size) / (2.0 * per_layer)


def pack_group(seqs: Sequence[np.ndarray], read_start: Sequence[int], read_count: int, rows: int,
               row_len: int, pad_id: int = 0) -> tuple[PackedRows, np.ndarray]:
    """Pack one group of token sequences into ``[rows, row_len]``.

    Args:
      seqs: 1-D int token arrays (valid tokens only; empty = an absent sequence).
      read_start: per sequence, the first read position inside it (``c - 1``).
      read_count: ``P``, positions read per sequence (``read_start + p``, clamped into the row).
      rows, row_len: the static shape (from :class:`ShapePolicy`).
    Returns:
      ``(PackedRows of NumPy [rows, row_len], gather [n, P] int32 flat indices)``; absent
      sequences gather slot 0 (their outputs are masked downstream).
    """
    lengths = [len(s) for s in seqs]
    place = first_fit_decreasing(lengths, row_len)
    if place.rows > rows:
        raise ValueError(f"packing needs {place.rows} rows, the shape has {rows}")
    tokens = np.full((rows, row_len), pad_id, np.int32)
    seg = np.zeros((rows, row_len), np.int32)
    pos = np.zeros((rows, row_len), np.int32)
    gather = np.zeros((len(seqs), read_count), np.int32)
    offs = np.arange(read_count)
    for j, s in enumerate(seqs):
        n = lengths[j]
        if n == 0:
            continue
        r, o = int(place.row[j]), int(place.start[j])
        tokens[r, o:o + n] = s
        seg[r, o:o + n] = j + 1
        pos[r, o:o + n] = np.arange(n)
        gather[j] = r * row_len + np.minimum(o + int(read_start[j]) + offs, row_len - 1)
    return PackedRows(tokens=tokens, segment_ids=seg, positions=pos), gather


def valid_tokens(ctx_valid: np.ndarray, act_valid: np.ndarray | None = None) -> np.ndarray:
    """Per-sequence valid token counts ``c (+ a)`` of ``[..., L]`` (and ``[..., K]``) masks."""
    n = ctx_valid.sum(-1)
    return n if act_valid is None else n + act_valid.sum(-1)


def sequence(ctx_tokens: np.ndarray, ctx_valid: np.ndarray, act_tokens: np.ndarray | None = None,
             act_valid: np.ndarray | None = None) -> np.ndarray:
    """The valid tokens of one context (left-padded) ‖ action (right-padded), 1-D int32."""
    parts = [ctx_tokens[ctx_valid]]
    if act_tokens is not None:
        parts.append(act_tokens[act_valid])
    return np.concatenate(parts).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# The update's groups: one per (epoch, minibatch, agent, micro-batch).


@flax.struct.dataclass
class UpdatePlan:
    """Packed inputs of every policy forward of one :func:`~marft_jax.rl.update.ppo_update`.

    perms: ``[E, M, b]`` int32, the batch rows of minibatch ``m`` of epoch ``e`` (the update
      uses these instead of drawing its own).
    rows: :class:`PackedRows` ``[E, M, N, u * R, T]``: agent ``i``'s sequences of the minibatch,
      micro-batch ``v`` in rows ``v*R .. (v+1)*R - 1``.
    gather: ``[E, M, N, S * b, K]`` int32, per sequence (the update's agent-major row order
      ``s * b + j``), flat indices into its micro-batch's ``R * T`` slots.
    """

    perms: jax.Array
    rows: PackedRows
    gather: jax.Array


def minibatch_perms(rng: jax.Array, batch: int, num_minibatches: int, epochs: int) -> np.ndarray:
    """The minibatch rows :func:`ppo_update` draws from ``state.rng``: ``[E, M, batch / M]``."""
    _, key = jax.random.split(rng)
    keys = jax.random.split(key, epochs)
    perms = jax.vmap(lambda k: jax.random.permutation(k, batch))(keys)
    return np.asarray(perms).reshape(epochs, num_minibatches, batch // num_minibatches)


def plan_update(ctx_tokens: np.ndarray, ctx_valid: np.ndarray, act_tokens: np.ndarray, act_valid: np.ndarray,
                perms: np.ndarray, *, micro_batches: int, policy: ShapePolicy,
                pad_id: int = 0) -> tuple[UpdatePlan, dict]:
    """Pack the update's policy forwards.

    Args:
      ctx_tokens, ctx_valid: ``[S, B, N, L]`` left-padded contexts; act_tokens, act_valid:
        ``[S, B, N, K]`` right-padded actions (canonical layout, NumPy).
      perms: ``[E, M, b]`` from :func:`minibatch_perms`.
      micro_batches: ``u``; the ``S * b`` sequences of an agent split into ``u`` contiguous groups.
      policy: the run's :class:`ShapePolicy` for update groups.
    Returns:
      ``(UpdatePlan, stats)`` with stats ``valid_tokens`` / ``computed_tokens`` over every policy
      forward (each (epoch, minibatch, agent) counted once).
    """
    S, B, N, L = ctx_tokens.shape
    K = act_tokens.shape[-1]
    E, M, b = perms.shape
    rows_per_agent = S * b
    if rows_per_agent % micro_batches:
        raise ValueError(f"ppo.micro_batches={micro_batches} must divide steps x minibatch rows = {rows_per_agent}")
    per_micro = rows_per_agent // micro_batches
    n_ctx = ctx_valid.sum(-1)
    n_act = act_valid.sum(-1)
    if np.any((n_ctx == 0) & (n_act > 0)):
        raise ValueError("an action without a context token cannot be scored (empty context)")

    def group_members(e, m, i, v):
        """(s, batch row) of the group's sequences in the update's row order."""
        rr = np.arange(v * per_micro, (v + 1) * per_micro)
        return rr // b, perms[e, m, rr % b]

    keys = [(e, m, i, v) for e in range(E) for m in range(M) for i in range(N) for v in range(micro_batches)]
    lengths = {}
    for k in keys:
        s_idx, b_idx = group_members(*k)
        lengths[k] = list(n_ctx[s_idx, b_idx, k[2]] + n_act[s_idx, b_idx, k[2]])
    R, T = policy.choose(list(lengths.values()))

    tok = np.zeros((E, M, N, micro_batches * R, T), np.int32)
    seg = np.zeros_like(tok)
    pos = np.zeros_like(tok)
    gather = np.zeros((E, M, N, rows_per_agent, K), np.int32)
    for k in keys:
        e, m, i, v = k
        s_idx, b_idx = group_members(*k)
        seqs = [sequence(ctx_tokens[s, bb, i], ctx_valid[s, bb, i], act_tokens[s, bb, i], act_valid[s, bb, i])
                for s, bb in zip(s_idx, b_idx)]
        starts = np.maximum(n_ctx[s_idx, b_idx, i] - 1, 0)
        rows, g = pack_group(seqs, starts, K, R, T, pad_id)
        sl = slice(v * R, (v + 1) * R)
        tok[e, m, i, sl], seg[e, m, i, sl], pos[e, m, i, sl] = rows.tokens, rows.segment_ids, rows.positions
        gather[e, m, i, v * per_micro:(v + 1) * per_micro] = g
    valid = int(sum(sum(x) for x in lengths.values()))
    stats = {"valid_tokens": valid, "computed_tokens": int(E * M * N * micro_batches * R * T),
             "rows": R, "row_len": T}
    return UpdatePlan(perms=perms.astype(np.int32), rows=PackedRows(tok, seg, pos), gather=gather), stats


def layout_costs(ctx_valid: np.ndarray, act_valid: np.ndarray, *, bucket: int = ROW_ALIGN) -> dict[str, int]:
    """Slots one pass over every sequence computes under the two unpacked layouts (an A/B of packing).

    ``padded``: every (step, row, agent) sequence padded to the trajectory's context bucket plus the
    token budget, ``[S*B*N, L + K]`` (the layout before packing). ``step_agent_buckets``: the played
    sequences of each (step, agent) padded to that group's longest, rounded up to ``bucket``. The
    packed layout's own count is in :func:`plan_update`'s stats.
    """
    S, B, N, L = ctx_valid.shape
    K = act_valid.shape[-1]
    n = ctx_valid.sum(-1) + act_valid.sum(-1)                               # [S, B, N]
    played = n > 0
    groups = 0
    for s in range(S):
        for i in range(N):
            rows = int(played[s, :, i].sum())
            if rows:
                groups += rows * align(int(n[s, :, i].max()), bucket)
    return {"padded": int(S * B * N * (L + K)), "step_agent_buckets": groups}
