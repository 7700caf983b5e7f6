"""Reuse of an agent's own prompt K/V across the sampler calls of one rollout.

In a multi-step episode the prompt agent ``i`` gets at step ``s + 1`` begins with most of the
one it got at step ``s``: the system prompt, the task and the earlier steps' history (only the
current step's part differs). The keys and values of those tokens depend on the tokens before
them, their positions and the agent's adapter only, so the sampler can copy them from the
earlier call's cache and run the prefill over the rest of the prompt alone.

:class:`PrefixStore` keeps, per set of agents a call samples (``{0}``, ``{1}`` in sequential
mode, ``{0, 1}`` for independent learners), the prompt part of the latest call's cache and the
prompts' tokens. A new call's row takes the longest common *token* prefix with a stored row
of the same agent (compared token by token, so a re-tokenization that differs only reuses what
is equal), at least :attr:`PrefixStore.min_tokens` and never the whole prompt (the last prompt
token is recomputed: its logits choose the first token). A store belongs to one set of weights:
the trainer opens one per rollout (``iteration.make_generate``) and drops it afterwards.

Layout of a reused prefill (``sampler.prefill(..., prefix=PrefixKV)``): the ``P`` reused slots
(right-aligned per row: row ``r``'s ``p_r`` prefix tokens fill slots ``P - p_r .. P - 1``) come
first, then the rest's bucket ``S`` (left-padded); the rest attends to both (the gap masked),
at RoPE positions continuing from ``p_r``. The cache is then compacted to the whole prompts'
bucket, each row's prompt right-aligned as a whole prefill leaves it, so the decode steps read
exactly the slots they would have read without the reuse.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class PrefixKV:
    """Reused prompt prefixes of one call's ``b`` rows: ``k``, ``v``
    ``[layer, b, kv_heads, P, head_dim]`` (row ``r``'s ``lengths[r]`` tokens right-aligned),
    ``valid`` ``[b, P]`` bool and ``lengths`` ``[b]`` int32 (0: nothing reused)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    lengths: jax.Array


@dataclasses.dataclass
class StoredPrompts:
    """One call's prompt K/V: ``k``, ``v`` ``[layer, b, kv_heads, slots, head_dim]`` (device),
    each row's whole prompt right-aligned in the ``slots`` (as every prefill leaves it), and per
    real row its ``tokens`` and its ``agent``."""

    k: jax.Array
    v: jax.Array
    tokens: list[np.ndarray]
    agents: np.ndarray

    def slot_of(self, row: int, j: int | np.ndarray) -> int | np.ndarray:
        """The slot holding token ``j`` of ``row``'s prompt."""
        return self.k.shape[3] - self.tokens[row].size + j


@dataclasses.dataclass(frozen=True)
class Match:
    """Per row of a new call (``n`` real rows): the stored row it reuses and how many tokens
    (``lengths`` 0: none)."""

    source_rows: np.ndarray
    lengths: np.ndarray

    @property
    def reused(self) -> int:
        return int(self.lengths.sum())


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays (also the shared prefixes of
    packed rows, :func:`marft_jax.rl.packing.share_prefixes`)."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@dataclasses.dataclass
class PrefixStore:
    """The latest call's prompt K/V per agent set (see the module docstring).

    ``min_tokens``: a row reuses a prefix only from this many tokens on (shorter ones save less
    than the copy costs)."""

    min_tokens: int = 32
    entries: dict[tuple[int, ...], StoredPrompts] = dataclasses.field(default_factory=dict)
    reused_tokens: int = 0          # prompt tokens not recomputed, over the store's calls

    @staticmethod
    def key(agents: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(set(int(a) for a in agents)))

    def match(self, prompts: Sequence[Sequence[int]], agents: Sequence[int]) -> Match | None:
        """The rows' reusable prefixes from the stored call of the same agent set (None: no
        stored call, or no row reuses :attr:`min_tokens` or more)."""
        entry = self.entries.get(self.key(agents))
        if entry is None:
            return None
        n = len(prompts)
        src, lens = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for r, (p, a) in enumerate(zip(prompts, agents)):
            p = np.asarray(p, np.int64)
            for j in np.flatnonzero(entry.agents == int(a)):
                m = min(common_prefix(p, entry.tokens[j]), p.size - 1)
                if m > lens[r]:
                    src[r], lens[r] = j, m
        lens[lens < self.min_tokens] = 0
        return Match(src, lens) if lens.any() else None

    def put(self, agents: Sequence[int], stored: StoredPrompts) -> None:
        """Keep ``stored`` as the latest call of its agent set (the earlier one is dropped)."""
        self.entries[self.key(agents)] = stored


def prefix_layout(match: Match, entry: StoredPrompts, batch: int, bucket: int) -> tuple[np.ndarray, ...]:
    """Host-side gather plan of ``match`` into ``batch`` rows of ``bucket`` prefix slots:
    ``(rows [batch] int32, slots [batch, bucket] int32, valid [batch, bucket] bool,
    lengths [batch] int32)``; row ``r``'s prefix token ``j`` goes to slot
    ``bucket - lengths[r] + j`` and is read from ``entry``'s slot ``slot_of(source row, j)``."""
    rows = np.zeros(batch, np.int32)
    slots = np.zeros((batch, bucket), np.int32)
    valid = np.zeros((batch, bucket), bool)
    lengths = np.zeros(batch, np.int32)
    n = match.lengths.size
    rows[:n], lengths[:n] = match.source_rows, match.lengths
    for r in range(n):
        p = int(match.lengths[r])
        if p:
            slots[r, bucket - p:] = entry.slot_of(int(match.source_rows[r]), np.arange(p))
            valid[r, bucket - p:] = True
    return rows, slots, valid, lengths


@jax.jit
def gather_prefix(k: jax.Array, v: jax.Array, rows: jax.Array, slots: jax.Array, valid: jax.Array,
                  lengths: jax.Array) -> PrefixKV:
    """The :class:`PrefixKV` of a gather plan (:func:`prefix_layout`) from a stored call's
    ``k``, ``v`` ``[layer, b_src, kv_heads, slots_src, head_dim]``."""
    def take(x):
        x = jnp.take(x, rows, axis=1)                                       # [L, b, kv, slots_src, D]
        return jnp.take_along_axis(x, slots[None, :, None, :, None], axis=3)
    return PrefixKV(k=take(k), v=take(v), valid=valid, lengths=lengths)


@functools.partial(jax.jit, static_argnames=("length",))
def prompt_slots(k: jax.Array, v: jax.Array, *, length: int) -> tuple[jax.Array, jax.Array]:
    """The first ``length`` slots of a cache's stacks (a copy: the decode donates the cache)."""
    return k[:, :, :, :length], v[:, :, :, :length]
