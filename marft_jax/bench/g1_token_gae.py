"""The reference implementation's token-level GAE loop, as its code is structured (benchmark baseline).

G1 (reference doc, quirk #4) computes MARFT-T advantages in its rollout buffer with Python
loops over rollout threads x steps x agents x tokens, on float32 NumPy buffers shaped
``[max_batch, episode_length (+1), threads, agents, (tokens)]``, finding each response's
length by walking back over pad tokens, and writing one element of the returns and advantages
buffers per token. This module re-expresses that loop nest (same buffers, same per-token
reads and writes) so that ``marft-jax bench backups`` can time the computation the way the
reference actually runs it.

:func:`marft_jax.bench.reference_backups.token_level_gae_reference` is the other baseline: a
clean transcription of the recurrence itself (the test oracle), about twice as fast as the
buffer loop because it works on float64 arrays without the buffer's extra leading axis.

Scope: G1's loop has no empty-response handling (its pad walk runs past index 0), so
:func:`g1_buffers` refuses rows with an empty response; with whole-episode rows (terminal or
truncated only at the last step) and every step played it equals ``token_level_gae`` with
``gamma``/``lam`` as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD = 0          # pad id in the action-token buffer; real tokens are >= 1 here


@dataclass
class G1Buffers:
    """The reference buffer's arrays for one on-policy batch (``max_batch = 1``).

    Shapes (E = steps, T = threads (rows), N = agents, K = max new tokens):
      values ``[1, E + 1, T, N, K]`` float32 (step E, agent 0, token 0 holds the bootstrap value);
      rewards ``[1, E, T, N]`` float32; masks ``[1, E + 1, T, N]`` float32 (``1 - done`` of the
      previous step); action_tokens ``[1, E, T, N, K]`` int64, ``PAD`` after each response;
      returns, advantages ``[1, E, T, N, K]`` float32 (written by the loop).
    """

    values: np.ndarray
    rewards: np.ndarray
    masks: np.ndarray
    action_tokens: np.ndarray
    returns: np.ndarray
    advantages: np.ndarray


def g1_buffers(reward, value, dp_mask, step_mask, terminal, truncated, v_boot) -> G1Buffers:
    """Fill the reference buffers from canonical ``[S, B, N, K]`` inputs (not timed).

    The per-agent reward is the placed reward at the response's last token. Raises
    ``ValueError`` for inputs outside the loop's scope (module doc).
    """
    reward, value = np.asarray(reward, np.float32), np.asarray(value, np.float32)
    dp = np.asarray(dp_mask, bool)
    step_mask, terminal = np.asarray(step_mask, bool), np.asarray(terminal, bool)
    steps, rows, agents, tokens = value.shape
    lengths = dp.sum(-1)
    if not step_mask.all():
        raise ValueError("G1 loop baseline: every step must be played (step_mask all true)")
    if (lengths == 0).any():
        raise ValueError("G1 loop baseline: empty responses are outside its scope (it walks past index 0)")
    if (dp != (np.arange(tokens) < lengths[..., None])).any():
        raise ValueError("G1 loop baseline: responses must be right-padded")
    if terminal[:-1].any():
        raise ValueError("G1 loop baseline: whole-episode rows only (terminal only at the last step)")
    values = np.zeros((1, steps + 1, rows, agents, tokens), np.float32)
    values[0, :steps] = value
    values[0, steps, :, 0, 0] = np.asarray(v_boot, np.float32)
    last = np.maximum(lengths - 1, 0)
    rewards = np.take_along_axis(reward, last[..., None], -1)[..., 0][None].astype(np.float32)
    masks = np.ones((1, steps + 1, rows, agents), np.float32)
    masks[0, 1:steps] = (1.0 - terminal[:-1].astype(np.float32))[..., None]
    # Ours bootstraps only truncated rows; G1 bootstraps whatever its mask leaves open.
    ends_open = np.asarray(truncated, bool)[-1] & ~terminal[-1]
    masks[0, steps] = ends_open.astype(np.float32)[:, None]
    action_tokens = np.where(dp, 1 + np.arange(tokens) % 7, PAD).astype(np.int64)[None]
    zeros = np.zeros((1, steps, rows, agents, tokens), np.float32)
    return G1Buffers(values, rewards, masks, action_tokens, zeros.copy(), zeros.copy())


def _last_token_position(tokens: np.ndarray) -> int:
    """Index of the last non-pad token (the reference walks back from the end)."""
    pos = len(tokens) - 1
    while tokens[pos] == PAD:
        pos -= 1
    return pos


def g1_token_gae(buf: G1Buffers, gamma: float, lam: float) -> None:
    """The reference's token-level GAE loop over threads, steps, agents and tokens.

    Writes ``buf.returns`` and ``buf.advantages`` in place. ``gae`` runs backwards through one
    thread's whole episode: token -> agent -> step.
    """
    b = 0                                                      # on-policy: one batch slot
    n_steps = buf.rewards.shape[1]
    n_threads, n_agents = buf.rewards.shape[2], buf.rewards.shape[3]
    for thread in range(n_threads):
        gae = 0
        for step in reversed(range(n_steps)):
            for agent in reversed(range(n_agents)):
                last = _last_token_position(buf.action_tokens[b, step, thread, agent, :])
                for token in reversed(range(last + 1)):
                    rew = buf.rewards[b, step, thread, agent]
                    v = buf.values[b, step, thread, agent, token]
                    if token == last:
                        if agent == n_agents - 1:
                            v_next = buf.values[b, step + 1, thread, 0, 0]
                            mask_next = buf.masks[b, step + 1, thread, 0]
                        else:
                            v_next = buf.values[b, step, thread, agent + 1, 0]
                            mask_next = buf.masks[b, step, thread, agent + 1]
                        delta = rew + gamma * v_next * mask_next - v
                        gae = delta + gamma * lam * mask_next * gae
                    else:
                        v_next = buf.values[b, step, thread, agent, token + 1]
                        delta = gamma * v_next - v
                        gae = delta + gamma * lam * gae
                    buf.returns[b, step, thread, agent, token] = gae + v
                    buf.advantages[b, step, thread, agent, token] = gae


def advantages_canonical(buf: G1Buffers) -> np.ndarray:
    """The loop's advantages in the canonical ``[S, B, N, K]`` layout."""
    return buf.advantages[0]
