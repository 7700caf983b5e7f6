"""Shape buckets and left padding of prompt batches.

Every distinct array shape is a new compile, so prompts are left-padded to a length bucket and
batches are padded with inactive dummy rows to a power-of-two batch bucket: a whole run
compiles a handful of programs. Length buckets are powers of two (:func:`length_bucket`); the
sampler uses finer ones for long prompts (:func:`prompt_bucket`: multiples of 128, then
quarter octaves, above 256), where a power of two would waste up to half of the prefill. Masks come from lengths (``valid`` is True for a
real token), never from comparing ids with the pad id.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def length_bucket(n: int, *, minimum: int = 16, maximum: int | None = None) -> int:
    """The smallest power of two ``>= max(n, minimum)``, capped at ``maximum``.

    The cap need not be a power of two (it is itself a bucket, e.g. a context limit).
    Raises ``ValueError`` when ``n`` exceeds ``maximum`` (a prompt that cannot fit).
    """
    if n < 0:
        raise ValueError(f"length must be >= 0, got {n}")
    if minimum < 1:
        raise ValueError(f"minimum bucket must be >= 1, got {minimum}")
    if maximum is not None and n > maximum:
        raise ValueError(f"length {n} exceeds the largest bucket {maximum}")
    b = _next_pow2(max(n, minimum))
    return b if maximum is None else min(b, int(maximum))


def prompt_bucket(n: int, *, minimum: int = 16, maximum: int | None = None,
                  fine_above: int | None = 256) -> int:
    """A length bucket that is a power of two up to ``fine_above``, finer above it.

    Above ``fine_above`` (a power of two) the bucket is the next multiple of
    ``max(128, 2^floor(log2(n - 1)) / 4)``: 384, 512, 640, 768, 896, 1024, 1280, 1536, ... (at
    most three extra buckets per octave, at most 25 % padding above 512 instead of up to 100 %).
    Capped at ``maximum`` like :func:`length_bucket`, which it equals for ``n <= fine_above``
    (and everywhere when ``fine_above`` is None).
    """
    b = length_bucket(n, minimum=minimum, maximum=maximum)
    if fine_above is None or n <= fine_above or b <= fine_above:
        return b
    granule = max(128, (1 << (int(n) - 1).bit_length()) // 8)   # a quarter of the octave's base
    fine = -(-int(n) // granule) * granule
    return min(b, fine)


def batch_bucket(n: int, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Padded batch size for ``n`` real rows: a power of two ``>= max(n, minimum)``, capped."""
    if n < 1:
        raise ValueError(f"batch must be >= 1, got {n}")
    return length_bucket(n, minimum=minimum, maximum=maximum)


class PaddedBatch(NamedTuple):
    """A bucketed, left-padded prompt batch.

    tokens: ``[batch, length]`` int32, real tokens at the right end, ``pad_id`` elsewhere.
    valid:  ``[batch, length]`` bool, True for a real token.
    active: ``[batch]`` bool, False for dummy rows added to reach the batch bucket.
    num_real: number of real rows (they come first: rows ``0 .. num_real - 1``).
    """

    tokens: np.ndarray
    valid: np.ndarray
    active: np.ndarray
    num_real: int


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token-id lists into ``(tokens [B, length] int32, valid [B, length] bool)``."""
    tokens = np.full((len(seqs), length), pad_id, np.int32)
    valid = np.zeros((len(seqs), length), bool)
    for i, s in enumerate(seqs):
        n = len(s)
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than the padded length {length}")
        if n:
            tokens[i, length - n:] = np.asarray(s, np.int64)
            valid[i, length - n:] = True
    return tokens, valid


def pad_batch(tokens: np.ndarray, valid: np.ndarray, batch: int, pad_id: int = 0) -> PaddedBatch:
    """Append dummy rows to reach ``batch`` rows; dummy rows are marked inactive.

    A dummy row holds one valid ``pad_id`` token at the right end, so no row of the model input
    is empty (no fully masked query row anywhere); its outputs are meaningless and dropped.
    """
    n, length = tokens.shape
    if batch < n:
        raise ValueError(f"batch bucket {batch} is smaller than the {n} real rows")
    extra = batch - n
    tok = np.concatenate([tokens, np.full((extra, length), pad_id, np.int32)]).astype(np.int32)
    val = np.concatenate([valid, np.zeros((extra, length), bool)])
    if extra and length:
        val[n:, -1] = True
    active = np.arange(batch) < n
    return PaddedBatch(tok, val, active, n)


def pad_prompts(
    seqs: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    min_length: int = 16,
    max_length: int | None = None,
    min_batch: int = 1,
    max_batch: int | None = None,
    fine_above: int | None = None,
) -> PaddedBatch:
    """Bucket and left-pad a list of prompts (token-id lists): ``[batch_bucket, length_bucket]``.

    Every prompt must have at least one token. ``fine_above``: use :func:`prompt_bucket`'s
    finer length buckets above this length (default None: powers of two only).
    """
    if not seqs:
        raise ValueError("pad_prompts needs at least one prompt")
    lens = [len(s) for s in seqs]
    if min(lens) < 1:
        raise ValueError(f"prompt {lens.index(min(lens))} is empty")
    length = prompt_bucket(max(lens), minimum=min_length, maximum=max_length, fine_above=fine_above)
    batch = batch_bucket(len(seqs), minimum=min_batch, maximum=max_batch)
    tokens, valid = left_pad(seqs, length, pad_id)
    return pad_batch(tokens, valid, batch, pad_id)
