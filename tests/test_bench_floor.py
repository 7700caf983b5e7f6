"""The floor's counting model (marft_jax.bench.floor) on shapes small enough to count by hand."""

from __future__ import annotations

import numpy as np
import pytest

from marft_jax.bench import floor
from marft_jax.models.config import ModelConfig

# 1 layer, H 4, 1 head of 4, MLP 8, vocab 10: per token the blocks take 320 FLOPs + 16 per
# attention key, the LM head 80 (2 x 4 x 10); 212 parameters (848 bytes in float32); K/V 32 bytes.
CFG = ModelConfig(arch="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
                  num_kv_heads=1, head_dim=4, tie_word_embeddings=True)


def _left(seq, width):
    tok, val = np.zeros(width, np.int32), np.zeros(width, bool)
    if seq:
        tok[width - len(seq):], val[width - len(seq):] = seq, True
    return tok, val


def _right(seq, width):
    tok, val = np.zeros(width, np.int32), np.zeros(width, bool)
    tok[:len(seq)], val[:len(seq)] = seq, True
    return tok, val


def _traj(ctx, act, L, K):
    """ctx / act: nested lists [S][B][N] of token lists -> the stage_work arrays."""
    S, B, N = len(ctx), len(ctx[0]), len(ctx[0][0])
    out = {k: np.zeros((S, B, N, w), t) for k, w, t in (("ctx_tokens", L, np.int32), ("ctx_valid", L, bool),
                                                         ("act_tokens", K, np.int32), ("act_valid", K, bool))}
    for s in range(S):
        for b in range(B):
            for i in range(N):
                out["ctx_tokens"][s, b, i], out["ctx_valid"][s, b, i] = _left(ctx[s][b][i], L)
                out["act_tokens"][s, b, i], out["act_valid"][s, b, i] = _right(act[s][b][i], K)
    return out


def test_hand_counted_one_agent_two_steps():
    assert CFG.flops_per_token(0) == 400 and CFG.flops_per_token(1) == 416 and CFG.num_params() == 212
    # step 0: context [1 2 3], response [4 5]; step 1: context [1 2 3 4 5 6] (extends it), response [7]
    arrays = _traj([[[[1, 2, 3]]], [[[1, 2, 3, 4, 5, 6]]]], [[[[4, 5]]], [[[7]]]], L=8, K=3)
    w = floor.stage_work(CFG, **arrays, step_mask=np.ones((2, 1), bool), itemsize=4, happo=True)
    # prefill: step 0 all 3 tokens (keys 1+2+3) + head; step 1 reuses [1 2 3 4] (the cache holds
    # the response without its last token): tokens 5 and 6 (keys 5+6) + head
    assert w["prefill"] == {"flops": (3 * 320 + 6 * 16 + 80) + (2 * 320 + 11 * 16 + 80), "bytes": 2 * 848, "tokens": 5}
    # decode: step 0's second token (4 keys, reads 3 cached K/V); step 1 has none
    assert w["decode"] == {"flops": 320 + 4 * 16 + 80, "bytes": 848 + 3 * 32, "tokens": 1}
    # critic: the trie of [1 2 3] and [1 2 3 4 5 6] = 6 tokens, keys 1..6, no LM head
    assert w["critic_features"] == {"flops": 6 * 320 + 21 * 16, "bytes": 848, "tokens": 6}
    # update: trie of [1..5] and [1..7] = 7 tokens (keys 28), head at 2 + 1 positions, 2 passes (N = 1)
    assert w["update"] == {"flops": 2 * (7 * 320 + 28 * 16 + 3 * 80), "bytes": 2 * 848, "tokens": 7}
    # a decode step reading a checkpoint's quantized blocks counts their bytes, the rest is unchanged
    q = floor.stage_work(CFG, **arrays, step_mask=np.ones((2, 1), bool), itemsize=4, happo=True,
                         decode_weight_bytes=100.0)
    assert q["decode"] == {**w["decode"], "bytes": 100 + 3 * 32} and q["prefill"] == w["prefill"]
    # padding does not change the count
    wide = floor.stage_work(CFG, **_traj([[[[1, 2, 3]]], [[[1, 2, 3, 4, 5, 6]]]], [[[[4, 5]]], [[[7]]]], L=20, K=9),
                            step_mask=np.ones((2, 1), bool))
    assert wide == w


def test_two_agents_happo_unplayed_rows_and_the_floor():
    # 2 rows x 2 agents, one step; row 1 is not played. Agents share the prefix [1 2] of row 0.
    arrays = _traj([[[[1, 2, 3], [1, 2, 4, 5]], [[9, 9], [9, 9]]]], [[[[6, 7], [8]], [[9], [9]]]], L=4, K=2)
    step = np.array([[True, False]])
    boot_tok, boot_val = np.zeros((2, 2, 4), np.int32), np.zeros((2, 2, 4), bool)
    boot_tok[0, 0], boot_val[0, 0] = _left([1, 2, 3, 6], 4)          # agent 0's next context
    w = floor.stage_work(CFG, **arrays, step_mask=step, boot_ctx_tokens=boot_tok, boot_ctx_valid=boot_val,
                         epochs=2, happo=True)
    # prefill: agent 0: 3 tokens (keys 6), agent 1: 4 tokens (keys 10); separate caches, separate calls
    assert w["prefill"]["flops"] == (3 * 320 + 6 * 16 + 80) + (4 * 320 + 10 * 16 + 80)
    assert w["prefill"]["bytes"] == 2 * 848
    # decode: agent 0 one step (keys 4, reads 3); agent 1 none
    assert w["decode"]["flops"] == 320 + 4 * 16 + 80 and w["decode"]["bytes"] == 848 + 3 * 32
    # critic: trie of [1 2 3], [1 2 4 5], [1 2 3 6] = 1 2 3 4 5 6 -> 6 tokens, keys 1+2+3+3+4+4
    assert w["critic_features"]["tokens"] == 6 and w["critic_features"]["flops"] == 6 * 320 + 17 * 16
    # update per epoch: agent 0 [1 2 3 6 7] (5 tokens, keys 15, 2 heads), agent 1 [1 2 4 5 8] (5, 15, 1);
    # passes 2 + 1/2 (HAPPO), 2 epochs
    fwd = 10 * 320 + 30 * 16 + 3 * 80
    assert w["update"]["flops"] == pytest.approx(2 * 2.5 * fwd) and w["update"]["tokens"] == 20
    no_happo = floor.stage_work(CFG, **arrays, step_mask=step, epochs=2, happo=False, critic_lora=True)
    crit = 5 * 320 + 13 * 16                                            # [1 2 3], [1 2 4 5] without the boot
    assert no_happo["update"]["flops"] == pytest.approx(2 * (2 * fwd + 2 * crit))

    # the floor: the bound that binds per stage, and their sum
    s = floor.floor_seconds(w, roofline_flops_per_s=1000.0, read_bytes_per_s=100.0)
    for k in floor.STAGES:
        assert s[k] == max(w[k]["flops"] / 1000.0, w[k]["bytes"] / 100.0)
    assert s["iteration"] == pytest.approx(sum(s[k] for k in floor.STAGES))
    assert s["decode"] == (848 + 96) / 100.0                             # bandwidth-bound
    with pytest.raises(ValueError, match="roofline"):
        floor.floor_seconds(w, 0.0, 1.0)
