"""Sequence packing: several (context ‖ action) sequences per row, so work follows valid tokens.

A trajectory stores every (step, row, agent) context left-padded to one bucket ``L`` and every
action right-padded to ``K``; a forward over ``[L + K]`` per sequence spends most of its work
on padding when contexts vary (the reference workload: contexts of 130-830 tokens, bucket 1024,
3.4x the valid tokens). Here the *valid* tokens of each sequence are laid end to end in rows of
``T`` slots (first-fit decreasing). Sequences fall into up to three *length classes*, each with
rows of its own length (a :data:`Shape`): dense attention costs each row ``T²``, so a 300-token
sequence packed into a 1,344-slot row would pay for the long ones. Per class:

* ``segment_ids [R, T]`` int32: ``j + 1`` on the tokens of the group's sequence ``j``, 0 on
  padding; the decoder's attention mask is block-diagonal causal over equal ids
  (``decoder.forward(..., segment_ids=...)``);
* ``positions [R, T]`` int32: RoPE positions restarting at 0 in every sequence (exactly the
  positions the padded layout gives, since those skip left padding);
* ``gather [n, P]`` int32 (one table for all classes): for sequence ``n``, the flat index (into
  the slots of its group, the classes end to end) of the hidden state at each of its ``P`` read positions. Actions read ``P = K``
  positions ``c - 1 + k`` (the one predicting action token ``k``, ``c`` = valid context tokens);
  action-level critic features read ``P = 1`` at ``c - 1``. Positions past a sequence's end are
  clamped into its row (they are masked downstream, as the padded layout's are).

Shared prefixes (``chains``): the sequences of one (row, agent) at successive steps often repeat
each other's beginning (system prompt, task and the earlier steps' history, then a new step and
the response). Such a chain becomes one *unit*: a trunk holding the shared tokens once, and one
branch per sequence for what follows its shared part (:func:`share_prefixes`). ``branch_ids``
``[R, T]`` int32 (0 = trunk, ``s + 1`` = member ``s``'s branch) add one rule to the mask: a
token attends to earlier trunk tokens of its segment and to earlier tokens of its own branch,
never to another branch. Every member then sees exactly its own token sequence at its own
positions, so its hidden states equal those of a forward over it alone (a causal model's
state at a position depends on the tokens before it only); only the repeated prefix is not
recomputed. On the reference workload (contexts 130-830 tokens over three steps) that is about
a third of the policy and feature passes' tokens.

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
from marft_jax.sampling.prefix_reuse import common_prefix

ROW_ALIGN = 32  # packed row lengths are multiples of this
# attention_cost_of counts FLOPs; measured on XLA:CPU (SmolLM2-135M, rows of 448 vs 1,344 slots),
# the dense attention of a LoRA gradient pass costs ~2x its FLOP share (its backward moves the
# [T, T] scores several times) and a forward pass ~0.7x.
BACKWARD_ATTENTION_WEIGHT = 2.0
FORWARD_ATTENTION_WEIGHT = 0.7


@dataclasses.dataclass(frozen=True)
class RowAssignment:
    """Where each sequence of one group went: ``row [n]`` (-1: not placed), ``start [n]`` (slot),
    ``rows`` used."""

    row: np.ndarray
    start: np.ndarray
    rows: int


def first_fit_decreasing(lengths: Sequence[int], row_len: int, max_rows: int | None = None) -> RowAssignment:
    """Place sequences of ``lengths`` into rows of ``row_len`` slots, longest first.

    Empty sequences (length 0) take no slot (row 0, start 0). Raises ``ValueError`` when a
    sequence is longer than a row. With ``max_rows``, a sequence that fits none of the rows once
    ``max_rows`` are open is left out (``row = -1``).
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
            if max_rows is not None and len(free) >= max_rows:
                row[j] = -1
                continue
            r = len(free)
            free.append(row_len)
        row[j], start[j] = r, row_len - free[r]
        free[r] -= n
    return RowAssignment(row=row, start=start, rows=len(free))


def align(n: int, multiple: int = ROW_ALIGN) -> int:
    """``n`` rounded up to a multiple (at least one multiple)."""
    return max(multiple, -(-int(n) // multiple) * multiple)


Shape = tuple[tuple[int, int], ...]
"""A packed shape: ``((rows, row_len), ...)``, one entry per length class, ``row_len`` ascending.
A sequence of ``n`` tokens goes to the first class with ``row_len >= n`` (:func:`class_of`)."""


def class_of(lengths: Sequence[int], row_lens: Sequence[int]) -> np.ndarray:
    """Index of the length class of each sequence: the first ``row_lens[c] >= n`` (ascending
    ``row_lens``; empty sequences go to class 0 and take no slot). Raises ``ValueError`` when a
    sequence is longer than the last class's rows."""
    lengths = np.asarray(lengths, np.int64)
    row_lens = np.asarray(row_lens, np.int64)
    if lengths.size and lengths.max() > row_lens[-1]:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a packed row of {int(row_lens[-1])}")
    return np.searchsorted(row_lens, lengths, side="left").astype(np.int32)


def place_classes(lengths: Sequence[int], shape: Shape) -> list[tuple[np.ndarray, RowAssignment]] | None:
    """Place one group into the classes of ``shape``: each sequence goes to the first class whose
    rows are long enough (:func:`class_of`) and, when that class's rows are full, overflows to the
    next one (so a compiled shape keeps fitting as lengths drift). Returns per class
    ``(indices of its sequences, their placement)``, or None when some sequence fits nowhere."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > shape[-1][1]:
        return None
    cls = class_of(lengths, [t for _, t in shape])
    pending = np.zeros(0, np.int64)
    out = []
    for c, (rows, row_len) in enumerate(shape):
        members = np.concatenate([pending, np.flatnonzero((cls == c) & (lengths > 0))])
        place = first_fit_decreasing(lengths[members], row_len, max_rows=rows)
        ok = place.row >= 0
        out.append((members[ok], RowAssignment(row=place.row[ok], start=place.start[ok], rows=place.rows)))
        pending = members[~ok]
    return None if pending.size else out


def shape_from_json(x) -> Shape:
    """A :data:`Shape` from its JSON lists (checkpoints); an old single-class ``[rows, row_len]``
    is read as one class."""
    if len(x) == 2 and all(isinstance(v, int) for v in x):
        x = [x]
    return tuple((int(r), int(t)) for r, t in x)


def shape_slots(shape: Shape) -> int:
    """Slots of one forward over every class of ``shape``."""
    return int(sum(r * t for r, t in shape))


def format_shape(shape: Shape) -> str:
    """``"2x640+4x864"``."""
    return "+".join(f"{r}x{t}" for r, t in shape)


@dataclasses.dataclass
class ShapePolicy:
    """Chooses the static packed :data:`Shape` of a set of groups and remembers what compiled.

    Every group (a list of sequence lengths) is packed to the same shape: up to ``max_classes``
    length classes, each a ``[rows, row_len]`` block of its own, so that short sequences do not
    pay the attention of long rows (dense attention is quadratic in the row length). The cost of
    a shape is the linear layers' work (its slots) plus each row's dense attention:
    ``Σ rows · row_len · (1 + row_len · attention_cost)`` (``attention_cost``: one query-key
    pair's cost over one token's linear cost, :func:`attention_cost_of` times a measured factor);
    an extra class must save ``class_gain`` of the cost (it is one more forward per call and
    more compiled shapes).

    Row lengths are tried from the groups' own (aligned) lengths, multiples of the longest by
    ``row_len_factors`` and splits of the largest group into ``1 .. max_split`` rows; class
    boundaries are chosen by dynamic programming over those candidates on a lower bound of
    first-fit-decreasing's rows (``max(⌈tokens / row_len⌉, #sequences > row_len / 2)``); the
    chosen shape's rows are then exact. A shape seen before is reused when every group fits it
    and it costs at most ``reuse_slack`` times the best fresh shape; otherwise the fresh shape is
    adopted (one more compile). ``minimum_row_len`` keeps tiny batches from compiling many
    small shapes.

    ``segment_attention``: the attention skips the keys of other segments (the CPU's native
    whole-row kernel, :mod:`marft_jax.models.causal_attention`), so each unit pays its own
    length² wherever it sits and a shape costs its slots alone (``attention_cost`` 0, set with
    it by :meth:`~marft_jax.train.run_state.RunState.configure`): rows hold as many units as fit,
    up to ``max_row_len`` slots (the row's ``[T, T]`` mask), units start at multiples of
    ``segment_align`` (where the kernel's backward may split a row), and row lengths snap to a
    grid of sixteenth steps (:func:`snap_row_len`) with a reuse slack of one step, so a run
    compiles a few shapes and pads a few percent.
    """

    reuse_slack: float = 1.25
    row_len_factors: tuple[float, ...] = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
    max_split: int = 8
    minimum_row_len: int = ROW_ALIGN
    attention_cost: float = 1.0 / 3000.0     # SmolLM2-135M; see attention_cost_of
    max_classes: int = 3
    class_gain: float = 0.05
    max_candidates: int = 24
    # Every class's rows are a multiple of this (the data shards the rows are split over).
    row_multiple: int = 1
    segment_attention: bool = False
    segment_align: int = 1
    max_row_len: int = 8192
    seen: list[Shape] = dataclasses.field(default_factory=list)

    def row_cost(self, rows: int, row_len: int) -> float:
        """Relative work of a ``[rows, row_len]`` packed forward (linear layers + dense attention)."""
        return rows * row_len * (1.0 + row_len * self.attention_cost)

    def slots_of(self, lengths) -> np.ndarray:
        """The slots units of ``lengths`` tokens take in a row (:func:`unit_slots`)."""
        return unit_slots(lengths, self.segment_align)

    def cost(self, shape: Shape) -> float:
        return sum(self.row_cost(r, t) for r, t in shape)

    def rows_needed(self, groups: Sequence[Sequence[int]], row_lens: Sequence[int]) -> list[int]:
        """Exact first-fit-decreasing rows per class (the most any group needs)."""
        need = [0] * len(row_lens)
        for g in groups:
            g = np.asarray(g, np.int64)
            cls = class_of(g, row_lens)
            for c, t in enumerate(row_lens):
                members = g[(cls == c) & (g > 0)]
                if members.size:
                    need[c] = max(need[c], first_fit_decreasing(members, t).rows)
        return need

    def fits(self, groups: Sequence[Sequence[int]], shape: Shape) -> bool:
        """Whether every group packs into ``shape`` (:func:`place_classes`, with overflow)."""
        return all(place_classes(g, shape) is not None for g in groups)

    def _candidates(self, groups: Sequence[Sequence[int]]) -> list[int]:
        lengths = np.concatenate([np.asarray(g, np.int64) for g in groups] + [np.zeros(1, np.int64)])
        lengths = lengths[lengths > 0]
        longest = int(lengths.max()) if lengths.size else 1
        base = max(align(longest), self.minimum_row_len)
        total = max([sum(g) for g in groups] + [1])
        own = sorted({max(align(n), self.minimum_row_len) for n in lengths.tolist()})
        if len(own) > self.max_candidates:   # quantiles of the groups' own lengths, the longest kept
            own = sorted({own[int(round(q))] for q in np.linspace(0, len(own) - 1, self.max_candidates)})
        top = {align(base * f) for f in self.row_len_factors}
        top |= {max(base, align(-(-total // r))) for r in range(1, self.max_split + 1)}
        cands = set(own) | top
        if self.segment_attention:
            cap = max(self.max_row_len, snap_row_len(base))
            cands = {snap_row_len(t) for t in cands} | {snap_row_len(base)}
            cands = {t for t in cands if t <= cap}
        return sorted(cands)

    def _fresh(self, groups: Sequence[Sequence[int]]) -> Shape:
        """The cheapest shape of at most ``max_classes`` classes (lower-bound rows, then exact)."""
        cands = self._candidates(groups)
        longest = max([max(g, default=0) for g in groups] + [1])
        sorted_groups = [np.sort(np.asarray([n for n in g if n > 0], np.int64)) for g in groups]
        sums = [np.concatenate([[0], np.cumsum(g)]) for g in sorted_groups]

        def lower_rows(lo: int, t: int) -> int:   # sequences with lo < n <= t in rows of t
            r = 0
            for g, cs in zip(sorted_groups, sums):
                a, b = np.searchsorted(g, lo, side="right"), np.searchsorted(g, t, side="right")
                if b > a:
                    half = max(a, np.searchsorted(g, t // 2, side="right"))
                    r = max(r, -(-int(cs[b] - cs[a]) // t), int(b - half))
            return r

        m = len(cands)
        inf = float("inf")
        # best[k][j]: cost of k classes covering every sequence <= cands[j], the last class cands[j].
        best = [[inf] * m for _ in range(self.max_classes + 1)]
        back: dict[tuple[int, int], int] = {}
        for j in range(m):
            best[1][j] = self.row_cost(lower_rows(0, cands[j]), cands[j])
        for k in range(2, self.max_classes + 1):
            for j in range(m):
                for i in range(j):
                    if best[k - 1][i] == inf:
                        continue
                    c = best[k - 1][i] + self.row_cost(lower_rows(cands[i], cands[j]), cands[j])
                    if c < best[k][j]:
                        best[k][j], back[(k, j)] = c, i
        bounds = []
        for k in range(1, self.max_classes + 1):
            for j in range(m):
                if cands[j] >= longest and best[k][j] < inf:
                    lens, kk, jj = [cands[j]], k, j
                    while kk > 1:
                        jj = back[(kk, jj)]
                        kk -= 1
                        lens.append(cands[jj])
                    bounds.append((best[k][j] * (1.0 + self.class_gain * (k - 1)), tuple(lens[::-1])))
        options = []
        for _, lens in sorted(bounds)[:8]:   # exact rows for the best few by the bound
            need = self.rows_needed(groups, lens)
            shape = tuple((r, t) for r, t in zip(need, lens) if r > 0) or ((1, lens[-1]),)
            options.append((self.cost(shape) * (1.0 + self.class_gain * (len(shape) - 1)), shape))
        return min(options)[1]

    def choose(self, groups: Sequence[Sequence[int]]) -> Shape:
        """The :data:`Shape` for packing every group of sequence lengths (unit tokens; each
        takes :meth:`slots_of` slots)."""
        groups = [self.slots_of(g).tolist() for g in groups]
        fresh = self._fresh(groups)
        slack = min(self.reuse_slack, 1.0 + 1.0 / SNAP_STEPS) if self.segment_attention else self.reuse_slack
        limit = slack * self.cost(fresh)
        fitting = [(self.cost(s), s) for s in self.seen if self.fits(groups, s) and self._aligned(s)]
        if fitting and min(fitting)[0] <= limit:
            return min(fitting)[1]
        # A new program either way: prefer growing a seen shape's rows (it then holds the old
        # lengths and the new, so the shapes stop churning) while that stays within the slack.
        longest = max([max(g, default=0) for g in groups] + [0])
        grown = []
        for s in self.seen:
            if s[-1][1] >= longest:
                need = self.rows_needed(groups, [t for _, t in s])
                g = tuple((max(r, n), t) for (r, t), n in zip(s, need))
                grown.append((self.cost(g), g))
        shape = min(grown)[1] if grown and min(grown)[0] <= limit else fresh
        m = self.row_multiple
        shape = tuple((-(-r // m) * m, t) for r, t in shape)
        self.seen.append(shape)
        return shape

    def _aligned(self, shape: Shape) -> bool:
        return all(r % self.row_multiple == 0 for r, _ in shape)


SNAP_STEPS = 16   # segment-mode row lengths: 16 steps per power of two


def unit_slots(lengths, segment_align: int = 1) -> np.ndarray:
    """The slots units of ``lengths`` tokens take in a row: rounded up to ``segment_align``."""
    return -(-np.asarray(lengths, np.int64) // segment_align) * segment_align


def snap_row_len(n: int) -> int:
    """``n`` rounded up to the grid of :data:`SNAP_STEPS` steps per power of two (multiples of
    :data:`ROW_ALIGN`): at most a sixteenth above ``n``; 5,058 -> 5,120."""
    n = align(n)
    octave = int(n).bit_length() - 1                      # 2**octave <= n
    step = max(ROW_ALIGN, 1 << max(0, octave - (SNAP_STEPS.bit_length() - 1)))
    return -(-n // step) * step


def attention_cost_of(cfg) -> float:
    """FLOPs of one query-key pair (scores + weighted values, every layer) over one token's
    FLOPs in the linear layers (projections and MLP, every layer) for a ``ModelConfig``."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return (4.0 * cfg.q_size) / (2.0 * per_layer)


def pack_group(seqs: Sequence[np.ndarray], read_start: Sequence[int], read_count: int, shape: Shape,
               pad_id: int = 0, units: Sequence[Unit] | None = None, *, branches: bool = True,
               segment_align: int = 1) -> tuple[tuple[PackedRows, ...], np.ndarray]:
    """Pack one group of token sequences into the classes of ``shape``.

    Args:
      seqs: 1-D int token arrays (valid tokens only; empty = an absent sequence).
      read_start: per sequence, the first read position inside it (``c - 1``).
      read_count: ``P``, positions read per sequence (``read_start + p``, clamped to its last).
      shape: the static :data:`Shape` (from :class:`ShapePolicy`).
      units: the sequences grouped by :func:`share_prefixes` (default: one unit per sequence).
      branches: emit ``branch_ids`` (shared prefixes). False: ``branch_ids`` is None, so the
        forward needs no dense mask and runs on the segment-id kernels (Pallas, splash); the units
        must then have no branches (built without chains).
      segment_align: units start at multiples of this (:attr:`ShapePolicy.segment_align`; the
        shape must have been chosen with it).
    Returns:
      ``(one PackedRows of NumPy [rows_c, row_len_c] per class, gather [n, P] int32)``: flat
      indices into the classes' slots laid end to end (class ``c`` from ``Σ_{c'<c} rows·row_len``;
      :func:`~marft_jax.models.decoder.forward_packed` returns hidden states in that order);
      absent sequences gather slot 0 (their outputs are masked downstream).
    """
    if units is None:
        units = share_prefixes(seqs)
    if not branches and any(u.branch.any() for u in units):
        raise ValueError("pack_group(branches=False) got units with shared-prefix branches")
    lengths = np.asarray([len(u.tokens) for u in units], np.int64)
    placed = place_classes(unit_slots(lengths, segment_align), shape)
    if placed is None:
        raise ValueError(f"sequences of {sorted(lengths.tolist(), reverse=True)} tokens do not fit the packed "
                         f"shape {format_shape(shape)}")
    gather = np.zeros((len(seqs), read_count), np.int32)
    offs = np.arange(read_count)
    out, base = [], 0
    for (rows, row_len), (members, place) in zip(shape, placed):
        tokens = np.full((rows, row_len), pad_id, np.int32)
        seg = np.zeros((rows, row_len), np.int32)
        pos = np.zeros((rows, row_len), np.int32)
        branch = np.zeros((rows, row_len), np.int32)
        for u, r, o in zip(members, place.row, place.start):
            unit, n, r, o = units[u], int(lengths[u]), int(r), int(o)
            tokens[r, o:o + n] = unit.tokens
            seg[r, o:o + n] = u + 1
            pos[r, o:o + n] = unit.positions
            branch[r, o:o + n] = unit.branch
            for j, slots in zip(unit.members, unit.slots):
                at = np.clip(int(read_start[j]) + offs, 0, len(slots) - 1)
                gather[j] = base + r * row_len + o + slots[at]
        out.append(PackedRows(tokens=tokens, segment_ids=seg, positions=pos, branch_ids=branch if branches else None))
        base += rows * row_len
    return tuple(out), gather


MIN_SHARED_PREFIX = 32  # tokens a chain member must share with the next to join its unit


@dataclasses.dataclass(frozen=True)
class Unit:
    """What one segment of a packed row holds: ``tokens``, ``branch`` ids (0 = trunk) and RoPE
    ``positions`` (``[n]`` int32 each); ``members`` (sequence indices) and per member
    ``slots [len(seq)]``: the unit offset holding each of its positions."""

    tokens: np.ndarray
    branch: np.ndarray
    positions: np.ndarray
    members: tuple[int, ...]
    slots: tuple[np.ndarray, ...]


def _unit(seqs: Sequence[np.ndarray], members: Sequence[int], shared: Sequence[int]) -> Unit:
    """One unit from chain ``members`` where member ``k`` shares ``shared[k]`` tokens with member
    ``k + 1`` (non-decreasing). Layout: trunk piece 0, branch 0, trunk piece 1, branch 1, ...;
    the last member has no branch (its tokens past the shared part extend the trunk)."""
    toks, branch, pos, slots = [], [], [], []
    trunk: list[np.ndarray] = []          # unit offsets of trunk positions 0, 1, ...
    off = prev = 0
    for k, j in enumerate(members):
        x = np.asarray(seqs[j], np.int32)
        p = shared[k] if k < len(members) - 1 else len(x)
        piece = x[prev:p]
        toks.append(piece), branch.append(np.zeros(len(piece), np.int32)), pos.append(np.arange(prev, p))
        trunk.append(off + np.arange(len(piece)))
        off += len(piece)
        trunk_slots = np.concatenate(trunk)
        rest = x[p:]
        if len(rest):
            toks.append(rest), branch.append(np.full(len(rest), k + 1, np.int32)), pos.append(np.arange(p, len(x)))
        slots.append(np.concatenate([trunk_slots[:p], off + np.arange(len(rest))]).astype(np.int32))
        off += len(rest)
        prev = p
    cat = lambda xs: np.concatenate(xs).astype(np.int32)
    return Unit(tokens=cat(toks), branch=cat(branch), positions=cat(pos), members=tuple(members), slots=tuple(slots))


def share_prefixes(seqs: Sequence[np.ndarray], chains: Sequence[tuple] | None = None,
                   min_shared: int = MIN_SHARED_PREFIX) -> list[Unit]:
    """Group sequences into :class:`Unit` s (non-empty sequences only).

    ``chains[j] = (key, order)``: sequences with the same ``key`` (e.g. one row and agent),
    taken by ``order`` (the step), join one unit while each shares at least ``min_shared``
    tokens with the next, and no fewer than the previous pair shared (the trunk only grows);
    otherwise a new unit starts. ``None``: one unit per sequence (no sharing).
    """
    lengths = [len(x) for x in seqs]
    if chains is None:
        return [_unit(seqs, [j], []) for j in range(len(seqs)) if lengths[j]]
    by_key: dict = {}
    for j, (key, order) in enumerate(chains):
        if lengths[j]:
            by_key.setdefault(key, []).append((order, j))
    units = []
    for key in by_key:
        members = [j for _, j in sorted(by_key[key])]
        cur, shared, last = [members[0]], [], 0
        for a, b in zip(members, members[1:]):
            p = common_prefix(np.asarray(seqs[a]), np.asarray(seqs[b]))
            if p >= max(min_shared, last):
                cur.append(b), shared.append(p)
                last = p
            else:
                units.append(_unit(seqs, cur, shared))
                cur, shared, last = [b], [], 0
        units.append(_unit(seqs, cur, shared))
    return units


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


# The row axis of PackedUpdate.rows ([E, M, N, u * R_c, T_c]): split over the data shards.
UPDATE_ROWS_AXIS = 3


@flax.struct.dataclass
class PackedUpdate:
    """Packed inputs of every policy forward of one :func:`~marft_jax.rl.update.ppo_update`.

    perms: ``[E, M, b]`` int32, the batch rows of minibatch ``m`` of epoch ``e`` (the update
      uses these instead of drawing its own).
    rows: one :class:`PackedRows` per length class ``c``, ``[E, M, N, u * R_c, T_c]``: agent
      ``i``'s sequences of the minibatch, micro-batch ``v`` in rows ``v*R_c .. (v+1)*R_c - 1``.
    gather: ``[E, M, N, S * b, K]`` int32, per sequence (the update's agent-major row order
      ``s * b + j``), flat indices into its micro-batch's slots (the classes end to end).
    """

    perms: jax.Array
    rows: tuple[PackedRows, ...]
    gather: jax.Array


def minibatch_perms(rng: jax.Array, batch: int, num_minibatches: int, epochs: int) -> np.ndarray:
    """The minibatch rows :func:`ppo_update` draws from ``state.rng``: ``[E, M, batch / M]``."""
    _, key = jax.random.split(rng)
    keys = jax.random.split(key, epochs)
    perms = jax.vmap(lambda k: jax.random.permutation(k, batch))(keys)
    return np.asarray(perms).reshape(epochs, num_minibatches, batch // num_minibatches)


def pack_update(ctx_tokens: np.ndarray, ctx_valid: np.ndarray, act_tokens: np.ndarray, act_valid: np.ndarray,
                perms: np.ndarray, *, micro_batches: int, policy: ShapePolicy,
                pad_id: int = 0, share: bool = False) -> tuple[PackedUpdate, dict]:
    """Pack the update's policy forwards.

    Args:
      ctx_tokens, ctx_valid: ``[S, B, N, L]`` left-padded contexts; act_tokens, act_valid:
        ``[S, B, N, K]`` right-padded actions (canonical layout, NumPy).
      perms: ``[E, M, b]`` from :func:`minibatch_perms`.
      micro_batches: ``u``; the ``S * b`` sequences of an agent split into ``u`` contiguous groups.
      policy: the run's :class:`ShapePolicy` for update groups.
      share: one unit per (row, agent) chain of steps inside a group (:func:`share_prefixes`):
        the prefix a step repeats from the one before is computed once.
    Returns:
      ``(PackedUpdate, stats)`` with stats ``valid_tokens`` (the sequences' tokens) /
      ``unique_tokens`` (after prefix sharing) / ``computed_tokens`` (slots) over every policy
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
    groups = {}
    for k in keys:
        e, m, i, v = k
        s_idx, b_idx = group_members(*k)
        seqs = [sequence(ctx_tokens[s, bb, i], ctx_valid[s, bb, i], act_tokens[s, bb, i], act_valid[s, bb, i])
                for s, bb in zip(s_idx, b_idx)]
        chains = list(zip(b_idx.tolist(), s_idx.tolist())) if share else None
        groups[k] = (seqs, share_prefixes(seqs, chains))
    shape = policy.choose([[len(u.tokens) for u in units] for _, units in groups.values()])

    names = ("tokens", "segment_ids", "positions") + (("branch_ids",) if share else ())
    rows = [PackedRows(**{n: np.zeros((E, M, N, micro_batches * r, t), np.int32) for n in names}) for r, t in shape]
    gather = np.zeros((E, M, N, rows_per_agent, K), np.int32)
    for k in keys:
        e, m, i, v = k
        s_idx, b_idx = group_members(*k)
        seqs, units = groups[k]
        starts = np.maximum(n_ctx[s_idx, b_idx, i] - 1, 0)
        classes, g = pack_group(seqs, starts, K, shape, pad_id, units=units, branches=share,
                                segment_align=policy.segment_align)
        for dst, src, (r, _) in zip(rows, classes, shape):
            sl = slice(v * r, (v + 1) * r)
            for name in names:
                getattr(dst, name)[e, m, i, sl] = getattr(src, name)
        gather[e, m, i, v * per_micro:(v + 1) * per_micro] = g
    valid = int(sum(len(x) for seqs, _ in groups.values() for x in seqs))
    unique = int(sum(len(u.tokens) for _, units in groups.values() for u in units))
    stats = {"valid_tokens": valid, "unique_tokens": unique,
             "computed_tokens": int(E * M * N * micro_batches * shape_slots(shape)), "shape": shape}
    return PackedUpdate(perms=perms.astype(np.int32), rows=tuple(rows), gather=gather), stats


def layout_costs(ctx_valid: np.ndarray, act_valid: np.ndarray, *, bucket: int = ROW_ALIGN) -> dict[str, int]:
    """Slots one pass over every sequence computes under the two unpacked layouts (an A/B of packing).

    ``padded``: every (step, row, agent) sequence padded to the trajectory's context bucket plus the
    token budget, ``[S*B*N, L + K]`` (the layout before packing). ``step_agent_buckets``: the played
    sequences of each (step, agent) padded to that group's longest, rounded up to ``bucket``. The
    packed layout's own count is in :func:`pack_update`'s stats.
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
