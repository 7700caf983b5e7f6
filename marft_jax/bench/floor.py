"""The physical floor of one training iteration: minimal FLOPs and bytes per stage, and seconds.

Pure counting (NumPy only, no model run), for ``bench iteration``. The counting model
(docs/benchmarks.md, "The floor"), per stage, from the played trajectory:

* **prefill**: one call per (step, agent) over the step's live rows (the chain orders agents).
  Each row prefills only the tokens its agent's cache does not hold yet: the longest common
  prefix with that agent's previous played step (its context ‖ its response without the last
  token, whose K/V is never computed) is reused; no bucket padding. A token at position ``p``
  attends over ``p + 1`` keys; the LM head runs once per row (the first sampled token).
  Bytes: the weights once per call.
* **decode**: response token ``t >= 1`` of a row is one decode step; a call runs as many steps
  as its longest response minus one, and every step reads the weights once (the LM head matrix
  included; as stored where a decode step reads a checkpoint's quantized blocks) plus, per live
  row, the K/V of the ``ctx + t - 1`` tokens before it. FLOPs: the
  live rows' tokens (blocks, attention over ``ctx + t`` keys, LM head).
* **critic features**: one forward through the blocks (no LM head) over the unique tokens of
  the row's critic contexts (every step and agent, and agent 0's bootstrap context): contexts
  sharing a prefix compute it once (a token trie per row). Bytes: the weights once.
* **update**: per PPO epoch, each agent's policy pass over the unique tokens of its (context ‖
  response) sequences per row (a trie, no padding): forward + the activation gradients of the
  frozen base (2x the forward FLOPs of the blocks and of the LM head at the response's
  predicting positions; LoRA's own FLOPs left out), plus HAPPO's extra forwards
  (``(N - 1) / N`` of a forward); no remat recompute. With a critic LoRA the critic's contexts
  take a forward + backward too (2x the critic-feature FLOPs); the value head alone is left out.
  Bytes: the weights once per forward or backward pass.

A stage's floor is ``max(flops / roofline, bytes / read bandwidth)`` (whichever bound binds);
the iteration's floor is the sum of its stages' floors.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

STAGES = ("prefill", "decode", "critic_features", "update")


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def trie_tokens(seqs: Iterable[Sequence[int]]) -> tuple[int, int]:
    """``(tokens, keys)`` of the unique-prefix trie of ``seqs``: a token shared as a common
    prefix is counted once; ``keys`` sums ``depth + 1`` over them (causal attention keys)."""
    root: dict = {}
    tokens = keys = 0
    for seq in seqs:
        node = root
        for d, t in enumerate(seq):
            nxt = node.get(int(t))
            if nxt is None:
                nxt = node[int(t)] = {}
                tokens += 1
                keys += d + 1
            node = nxt
    return tokens, keys


class _Cost:
    """Per-token FLOPs of a config: ``body0 + attn * keys`` through the blocks, ``head`` for the LM head."""

    def __init__(self, cfg):
        self.head = 2.0 * cfg.hidden_size * cfg.vocab_size
        self.body0 = float(cfg.flops_per_token(0)) - self.head
        self.attn = float(cfg.flops_per_token(1)) - float(cfg.flops_per_token(0))

    def body(self, tokens: int, keys: int) -> float:
        return tokens * self.body0 + keys * self.attn


def weight_bytes(cfg, itemsize: int) -> float:
    """Bytes of the base weights a forward reads: every parameter once (the LM head matrix; an
    untied embedding table is only gathered from, one row a token, and is left out)."""
    params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    return float(params) * itemsize


def kv_bytes_per_token(cfg, itemsize: int) -> float:
    """K and V of one token in every layer."""
    return 2.0 * cfg.num_layers * cfg.kv_size * itemsize


def _seq(tokens: np.ndarray, valid: np.ndarray) -> list[int]:
    return tokens[valid].tolist()


def stage_work(cfg, *, ctx_tokens, ctx_valid, act_tokens, act_valid, step_mask, boot_ctx_tokens=None,
               boot_ctx_valid=None, critic_ctx_tokens=None, critic_ctx_valid=None, itemsize: int = 4,
               epochs: int = 1, happo: bool = True, critic_lora: bool = False,
               decode_weight_bytes: float | None = None) -> dict[str, dict[str, float]]:
    """Minimal ``{stage: {"flops", "bytes", "tokens"}}`` of one iteration (module docstring).

    Args:
      cfg: the model's :class:`~marft_jax.models.config.ModelConfig`.
      ctx_tokens, ctx_valid: ``[S, B, N, L]`` contexts (valid slots mark the tokens, in order).
      act_tokens, act_valid: ``[S, B, N, K]`` responses.
      step_mask: ``[S, B]`` played steps.
      boot_ctx_tokens, boot_ctx_valid: ``[B, N, L]`` next-step contexts (agent 0's is valued).
      critic_ctx_tokens, critic_ctx_valid: the critic's contexts where they differ (else None).
      itemsize: bytes per weight and K/V element (4 for float32).
      epochs: PPO epochs; happo: HAPPO's extra forwards; critic_lora: the critic trains a LoRA.
      decode_weight_bytes: the weight bytes one decode step reads when they are not ``itemsize``
        per parameter (a GGUF checkpoint's blocks read by ``model.decode_weights=native``).
    ``tokens``: tokens through the blocks (prefill, critic, update per epoch) or decode row-steps.
    """
    ctx_tokens, ctx_valid = np.asarray(ctx_tokens), np.asarray(ctx_valid, bool)
    act_tokens, act_valid = np.asarray(act_tokens), np.asarray(act_valid, bool)
    step_mask = np.asarray(step_mask, bool)
    S, B, N, _ = ctx_tokens.shape
    cost = _Cost(cfg)
    wbytes, kvb = weight_bytes(cfg, itemsize), kv_bytes_per_token(cfg, itemsize)
    act_len = act_valid.sum(-1)
    pre = dict(flops=0.0, bytes=0.0, tokens=0)
    dec = dict(flops=0.0, bytes=0.0, tokens=0)
    cached: dict[tuple[int, int], list[int]] = {}        # (row, agent) -> tokens in its KV cache
    for s in range(S):
        for i in range(N):
            rows = [b for b in np.flatnonzero(step_mask[s]) if act_len[s, b, i] > 0]
            if not rows:
                continue
            pre["bytes"] += wbytes
            steps = int(max(act_len[s, b, i] for b in rows)) - 1
            dec["bytes"] += steps * (wbytes if decode_weight_bytes is None else decode_weight_bytes)
            for b in rows:
                ctx = _seq(ctx_tokens[s, b, i], ctx_valid[s, b, i])
                reuse = _lcp(ctx, cached.get((b, i), []))
                new = len(ctx) - reuse
                keys = (reuse + 1 + len(ctx)) * new // 2                  # positions reuse .. len-1, +1 each
                pre["flops"] += cost.body(new, keys) + cost.head
                pre["tokens"] += new
                n_act = int(act_len[s, b, i])
                c = len(ctx)
                # decode steps t = 1 .. n_act - 1: keys c + t, K/V read c + t - 1
                t_sum = (n_act - 1) * n_act // 2
                dec["flops"] += (n_act - 1) * (cost.body0 + cost.head) + cost.attn * ((n_act - 1) * c + t_sum)
                dec["bytes"] += kvb * ((n_act - 1) * (c - 1) + t_sum)
                dec["tokens"] += n_act - 1
                cached[(b, i)] = ctx + _seq(act_tokens[s, b, i], act_valid[s, b, i])[:n_act - 1]
    # critic features: a trie per row over its critic contexts (+ agent 0's bootstrap context)
    cctx = ctx_tokens if critic_ctx_tokens is None else np.asarray(critic_ctx_tokens)
    cval = ctx_valid if critic_ctx_valid is None else np.asarray(critic_ctx_valid, bool)
    crit_tokens = crit_keys = 0
    for b in range(B):
        seqs = [_seq(cctx[s, b, i], cval[s, b, i]) for s in range(S) if step_mask[s, b] for i in range(N)
                if act_len[s, b, i] > 0]
        if boot_ctx_valid is not None and np.asarray(boot_ctx_valid)[b, 0].any():
            seqs.append(_seq(np.asarray(boot_ctx_tokens)[b, 0], np.asarray(boot_ctx_valid, bool)[b, 0]))
        t, k = trie_tokens(seqs)
        crit_tokens, crit_keys = crit_tokens + t, crit_keys + k
    crit_flops = cost.body(crit_tokens, crit_keys)
    crit = dict(flops=crit_flops, bytes=wbytes if crit_tokens else 0.0, tokens=crit_tokens)
    # update: per (row, agent) a trie of context ‖ response; LM head at the predicting positions
    upd_tokens = upd_keys = heads = 0
    for b in range(B):
        for i in range(N):
            seqs = [_seq(ctx_tokens[s, b, i], ctx_valid[s, b, i]) + _seq(act_tokens[s, b, i], act_valid[s, b, i])
                    for s in range(S) if step_mask[s, b] and act_len[s, b, i] > 0]
            t, k = trie_tokens(seqs)
            upd_tokens, upd_keys = upd_tokens + t, upd_keys + k
            heads += sum(int(act_len[s, b, i]) for s in range(S) if step_mask[s, b])
    fwd = cost.body(upd_tokens, upd_keys) + heads * cost.head
    passes = 2.0 + ((N - 1) / N if happo and N > 1 else 0.0)
    upd_flops = epochs * (passes * fwd + (2.0 * crit_flops if critic_lora else 0.0))
    upd_bytes = epochs * wbytes * (N * passes + (2.0 if critic_lora else 0.0)) if upd_tokens else 0.0
    upd = dict(flops=upd_flops, bytes=upd_bytes, tokens=epochs * upd_tokens)
    return {"prefill": pre, "decode": dec, "critic_features": crit, "update": upd}


def floor_seconds(work: Mapping[str, Mapping[str, float]], roofline_flops_per_s: float,
                  read_bytes_per_s: float) -> dict[str, float]:
    """``{stage: max(flops / roofline, bytes / bandwidth)}`` plus ``"iteration"``: their sum."""
    if roofline_flops_per_s <= 0 or read_bytes_per_s <= 0:
        raise ValueError(f"the floor needs a positive roofline and read bandwidth, got "
                         f"{roofline_flops_per_s} FLOP/s and {read_bytes_per_s} B/s")
    out = {k: max(w["flops"] / roofline_flops_per_s, w["bytes"] / read_bytes_per_s) for k, w in work.items()}
    out["iteration"] = sum(out.values())
    return out
