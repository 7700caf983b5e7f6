"""The rollout's output: one batch of arrays in the canonical layout, no strings.

Every array carries the step axis first (S = 1 for single-step tasks), then
``[batch, agent, token]`` (docs/algorithm.md#notation-and-layout). Decoded texts stay on the host in
:class:`RolloutTexts` for scoring and logging; the training path only sees this pytree.
"""

from __future__ import annotations

import flax.struct
import jax

from marft_jax.rl import layout


@flax.struct.dataclass
class Trajectory:
    """A batch of episodes.

    Attributes (S steps, B rows, N agents, L context slots, K action slots):
      ctx_tokens, ctx_valid: ``[S, B, N, L]`` int32 / bool, agent i's context at step s,
        left-padded.
      act_tokens, act_valid: ``[S, B, N, K]`` int32 / bool, the response, right-padded;
        ``act_valid[..., k] = k < length``.
      sample_logp: ``[S, B, N, K]`` float32, the sampler's log-probs (logged as a mismatch
        metric against the recomputed ``logp_old``).
      word_count: ``[S, B, N]`` int32, whitespace-separated words of the decoded response
        (``word`` log-prob normalization).
      step_mask: ``[S, B]`` bool, step s was played.
      terminal, truncated: ``[S, B]`` bool, the episode ended at s by termination / a step cap
        or a next step whose contexts do not fit the window (``rollout.overflow=end_episode``).
      score: ``[S, B]`` float32, verifier score of the step (answering agent), in [0, 1].
      agent_score: ``[S, B, N]`` float32, each agent's own score (independent PPO), else
        a copy of ``score``.
      boot_ctx_tokens, boot_ctx_valid: ``[B, N, L]`` each agent's next-step context, the
        bootstrap state of truncated rows (all-pad elsewhere). The chained backup reads agent
        0's; independent PPO reads every agent's own.
      budget_clipped: ``[S, B, N]`` bool, the response hit its token budget.
      policy_logp, entropy: ``[S, B, N, K]`` float32 or None, the sampler's log-probs and
        entropies under the policy itself (full vocabulary, training temperature), 0 after
        each response; PPO's old log-probs when present (no recompute forward).
      critic_ctx_tokens, critic_ctx_valid: ``[S, B, N, L]`` or None, the centralized critic's
        state at agent i when it differs from agent i's own context: the joint history
        (outputs of agents 0 .. i-1 of the step) on a team graph that is not the chain
        (:meth:`~marft_jax.rl.topology.Topology.critic_reads_all_earlier`); None = the
        critic reads ``ctx_tokens``.
    """

    ctx_tokens: jax.Array
    ctx_valid: jax.Array
    act_tokens: jax.Array
    act_valid: jax.Array
    sample_logp: jax.Array
    word_count: jax.Array
    step_mask: jax.Array
    terminal: jax.Array
    truncated: jax.Array
    score: jax.Array
    agent_score: jax.Array
    boot_ctx_tokens: jax.Array
    boot_ctx_valid: jax.Array
    budget_clipped: jax.Array
    policy_logp: jax.Array | None = None
    entropy: jax.Array | None = None
    critic_ctx_tokens: jax.Array | None = None
    critic_ctx_valid: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(S, B, N, L, K)``."""
        s, b, n, l = self.ctx_tokens.shape
        return s, b, n, l, self.act_tokens.shape[-1]

    def check(self) -> None:
        """Assert the canonical layout of every field."""
        sizes = layout.assert_layout(self.ctx_tokens, "ctx_tokens", (*layout.ACTION_AXES, "ctx"))
        layout.assert_layout(self.ctx_valid, "ctx_valid", (*layout.ACTION_AXES, "ctx"), sizes=sizes)
        for name in ("critic_ctx_tokens", "critic_ctx_valid"):
            if getattr(self, name) is not None:
                layout.assert_layout(getattr(self, name), name, (*layout.ACTION_AXES, "ctx"), sizes=sizes)
        sizes = layout.assert_layout(self.act_tokens, "act_tokens", layout.TOKEN_AXES, sizes=sizes)
        for name in ("act_valid", "sample_logp", "policy_logp", "entropy"):
            if getattr(self, name) is None:
                continue
            layout.assert_layout(getattr(self, name), name, layout.TOKEN_AXES, sizes=sizes)
        for name in ("word_count", "agent_score", "budget_clipped"):
            layout.assert_layout(getattr(self, name), name, layout.ACTION_AXES, sizes=sizes)
        for name in ("step_mask", "terminal", "truncated", "score"):
            layout.assert_layout(getattr(self, name), name, layout.STEP_AXES, sizes=sizes)
