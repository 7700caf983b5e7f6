"""NumPy loop transcription of the specified backups (docs/algorithm.md#gae-backups): the test
oracle and the benchmark baseline.

Written in the style of G1's buffers (``marft/buffers/*_level_buffer.py``): nested Python loops
over rows, steps (reverse), agents (reverse) and tokens (reverse), reading values and already
computed advantages out of the arrays by index. Unlike G1 it skips agents with no tokens (the
link goes to the next agent that has tokens, searched explicitly), separates ``terminal`` from
``truncated``, and never crashes on an empty response. It deliberately does *not* use the
unified carry formulation of ``marft_jax.rl.backups``; it follows the per-level cases of
docs/algorithm.md#action-level-backup and docs/algorithm.md#token-level-backup.

Inputs are the canonical-layout arrays (``[S, B, N]`` or ``[S, B, N, K]``, ``[S, B]``, ``[B]``)
as NumPy arrays; computation is in float64; outputs are float64 ``(advantages, returns)`` in the
input layout, zero on invalid decision points. ``reward`` may be nonzero on any valid point
(the token-level backup has it only on an agent's last token; a reward inside a response is
simply added to that token's delta).

``g1_masks=True`` mirrors G1's masks: the agent ``i -> i+1`` link of step s is multiplied by
``mask_s = 1 - terminal_{s-1}`` (``mask_0 = 1``), and the end of the row bootstraps whenever the
last played step is not terminal (``truncated`` ignored).
"""

from __future__ import annotations

import numpy as np


def _bootstrap(b, step_mask, terminal, truncated, v_boot_b, g1_masks):
    """(value of the virtual end point, index of the last played step) for row b."""
    played = [s for s in range(step_mask.shape[0]) if step_mask[s, b]]
    if not played:
        return 0.0, -1
    s_star = played[-1]
    term = bool(terminal[s_star, b])
    if g1_masks:
        use = not term
    else:
        use = bool(truncated[s_star, b]) and not term
    return (float(v_boot_b) if use else 0.0), s_star


def _continues(terminal, step_mask, s, b):
    """e_s: 1 if the episode continues after played step s."""
    return 0.0 if (terminal[s, b] and step_mask[s, b]) else 1.0


def _g1_step_mask(terminal, step_mask, s, b):
    """G1's masks[s] = 1 - done_{s-1}; masks[0] = 1."""
    if s == 0:
        return 1.0
    return 0.0 if (terminal[s - 1, b] and step_mask[s - 1, b]) else 1.0


# ----------------------------------------------------------------------------------------------
# (a) action level


def action_level_gae_reference(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                               *, gamma, lam, g1_masks=False):
    """docs/algorithm.md#action-level-backup: reverse over s, then i = N-1 .. 0, skipping invalid (s, i).

    Shapes: reward/value/dp_mask ``[S, B, N]``; step_mask/terminal/truncated ``[S, B]``;
    v_boot ``[B]``. Returns ``(adv, ret)`` ``[S, B, N]`` float64.
    """
    reward = np.asarray(reward, np.float64)
    value = np.asarray(value, np.float64)
    dp = np.asarray(dp_mask, bool) & np.asarray(step_mask, bool)[:, :, None]
    step_mask = np.asarray(step_mask, bool)
    num_steps, batch, num_agents = value.shape
    adv = np.zeros_like(value)
    for b in range(batch):
        v_end, s_star = _bootstrap(b, step_mask, terminal, truncated, v_boot[b], g1_masks)
        for s in reversed(range(num_steps)):
            if not step_mask[s, b]:
                continue
            for i in reversed(range(num_agents)):
                if not dp[s, b, i]:
                    continue
                # the next agent of this step with a decision point
                nxt = None
                for j in range(i + 1, num_agents):
                    if dp[s, b, j]:
                        nxt = (value[s, b, j], adv[s, b, j], 1.0)
                        break
                quirk = _g1_step_mask(terminal, step_mask, s, b) if (g1_masks and i < num_agents - 1) else 1.0
                if nxt is None:
                    # i is the last acting agent of step s: agent 0 (first acting) of a later step
                    c = _continues(terminal, step_mask, s, b)
                    s2 = s + 1
                    while nxt is None and s2 < num_steps and step_mask[s2, b]:
                        for j in range(num_agents):
                            if dp[s2, b, j]:
                                nxt = (value[s2, b, j], adv[s2, b, j], c)
                                break
                        c *= _continues(terminal, step_mask, s2, b)
                        s2 += 1
                    if nxt is None:
                        nxt = (v_end, 0.0, c)
                v_next, a_next, c = nxt
                c *= quirk
                delta = reward[s, b, i] + gamma * c * v_next - value[s, b, i]
                adv[s, b, i] = delta + gamma * lam * c * a_next
    ret = np.where(dp, adv + value, 0.0)
    return adv, ret


# ----------------------------------------------------------------------------------------------
# (b) token level


def token_level_gae_reference(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                              *, gamma, lam, g1_masks=False):
    """docs/algorithm.md#token-level-backup: reverse over s, i, k; an agent's last token links to
    the first token of the next agent with tokens (factor 1), the last such agent of a step to the
    first acting agent of the next step (factor e_s), the end of the row to the bootstrap value.

    Shapes: reward/value/dp_mask ``[S, B, N, K]``; step_mask/terminal/truncated ``[S, B]``;
    v_boot ``[B]``. Returns ``(adv, ret)`` ``[S, B, N, K]`` float64.
    """
    reward = np.asarray(reward, np.float64)
    value = np.asarray(value, np.float64)
    dp = np.asarray(dp_mask, bool) & np.asarray(step_mask, bool)[:, :, None, None]
    step_mask = np.asarray(step_mask, bool)
    num_steps, batch, num_agents, max_len = value.shape
    adv = np.zeros_like(value)

    def tokens(s, b, i):
        return [k for k in range(max_len) if dp[s, b, i, k]]

    for b in range(batch):
        v_end, s_star = _bootstrap(b, step_mask, terminal, truncated, v_boot[b], g1_masks)
        for s in reversed(range(num_steps)):
            if not step_mask[s, b]:
                continue
            for i in reversed(range(num_agents)):
                toks = tokens(s, b, i)
                if not toks:
                    continue                       # K = 0: no decision points, skipped
                last = toks[-1]
                for pos in reversed(range(len(toks))):
                    k = toks[pos]
                    if k != last:
                        # inside the response: next token of the same agent
                        kn = toks[pos + 1]
                        delta = reward[s, b, i, k] + gamma * value[s, b, i, kn] - value[s, b, i, k]
                        adv[s, b, i, k] = delta + gamma * lam * adv[s, b, i, kn]
                        continue
                    # the agent's last token
                    nxt = None
                    for j in range(i + 1, num_agents):
                        tj = tokens(s, b, j)
                        if tj:
                            nxt = (value[s, b, j, tj[0]], adv[s, b, j, tj[0]], 1.0)
                            break
                    if nxt is None:
                        c = _continues(terminal, step_mask, s, b)
                        s2 = s + 1
                        while nxt is None and s2 < num_steps and step_mask[s2, b]:
                            for j in range(num_agents):
                                tj = tokens(s2, b, j)
                                if tj:
                                    nxt = (value[s2, b, j, tj[0]], adv[s2, b, j, tj[0]], c)
                                    break
                            c *= _continues(terminal, step_mask, s2, b)
                            s2 += 1
                        if nxt is None:
                            nxt = (v_end, 0.0, c)
                    v_next, a_next, c = nxt
                    if g1_masks and i < num_agents - 1:
                        c *= _g1_step_mask(terminal, step_mask, s, b)
                    delta = reward[s, b, i, k] + gamma * c * v_next - value[s, b, i, k]
                    adv[s, b, i, k] = delta + gamma * lam * c * a_next
    ret = np.where(dp, adv + value, 0.0)
    return adv, ret


# ----------------------------------------------------------------------------------------------
# Independent PPO (docs/algorithm.md#independent-learners)


def independent_gae_reference(reward, value, dp_mask, step_mask, terminal, truncated, v_boot,
                              *, gamma, lam):
    """Independent PPO: agent i's points over steps, no link to other agents.

    Shapes: ``[S, B, N]`` or ``[S, B, N, K]``; v_boot ``[B, N]``. Returns float64 ``(adv, ret)``.
    """
    value = np.asarray(value, np.float64)
    action_level = value.ndim == 3
    if action_level:
        value = value[..., None]
        reward = np.asarray(reward, np.float64)[..., None]
        dp_mask = np.asarray(dp_mask, bool)[..., None]
    reward = np.asarray(reward, np.float64)
    step_mask = np.asarray(step_mask, bool)
    dp = np.asarray(dp_mask, bool) & step_mask[:, :, None, None]
    num_steps, batch, num_agents, max_len = value.shape
    adv = np.zeros_like(value)
    for b in range(batch):
        for i in range(num_agents):
            v_end, _ = _bootstrap(b, step_mask, terminal, truncated, v_boot[b, i], False)
            for s in reversed(range(num_steps)):
                if not step_mask[s, b]:
                    continue
                toks = [k for k in range(max_len) if dp[s, b, i, k]]
                for pos in reversed(range(len(toks))):
                    k = toks[pos]
                    if pos + 1 < len(toks):
                        v_next, a_next, c = value[s, b, i, toks[pos + 1]], adv[s, b, i, toks[pos + 1]], 1.0
                    else:
                        nxt = None
                        c = _continues(terminal, step_mask, s, b)
                        s2 = s + 1
                        while nxt is None and s2 < num_steps and step_mask[s2, b]:
                            t2 = [kk for kk in range(max_len) if dp[s2, b, i, kk]]
                            if t2:
                                nxt = (value[s2, b, i, t2[0]], adv[s2, b, i, t2[0]], c)
                            c *= _continues(terminal, step_mask, s2, b)
                            s2 += 1
                        v_next, a_next, c = nxt if nxt is not None else (v_end, 0.0, c)
                    delta = reward[s, b, i, k] + gamma * c * v_next - value[s, b, i, k]
                    adv[s, b, i, k] = delta + gamma * lam * c * a_next
    ret = np.where(dp, adv + value, 0.0)
    if action_level:
        return adv[..., 0], ret[..., 0]
    return adv, ret
