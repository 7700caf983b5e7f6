"""The reference (G1) pipeline's stages in PyTorch + PEFT, for ``bench iteration``.

One G1 iteration on the host code's trajectory layout, stage by stage, the way the reference
implementation (``marft/mas/mas.py``, ``marft/buffers/action_level_buffer.py``,
``marft/algorithms/appo_trainer.py``) computes it:

* **rollout**: :meth:`G1Pipeline.generate` is a :data:`~marft_jax.rl.rollout.GenerateFn` for
  :func:`marft_jax.rl.rollout.rollout`, so the prompts come from the same host code as ours.
  Each call runs HF ``generate`` on the acting agent's own PEFT model copy, prompts left-padded
  to the longest in the call, sampling at the workload's temperature / top-k with a fresh
  ``GenerationConfig`` (nothing inherited from a checkpoint), the run's stop set (none with
  ``no_eos``);
* **values, log-probs, backup** (:meth:`G1Pipeline.prepare`): per played step and agent, as
  G1's ``infer_for_rollout`` after each env step: the critic copy's full ``CausalLM`` forward
  (LM head included, ``output_hidden_states``) over the contexts padded to the step's longest,
  the value head on the last position; two policy forwards over context ‖ action (G1's
  ``rho``/``pi`` pair, both no-grad here), ``get_slice`` into ``[B, 1, K, V]``, full-vocabulary
  ``log_softmax`` and per-row gather / ``Categorical`` entropy loops; the bootstrap value of
  truncated rows by one more critic forward; then G1's buffer loop for the backup
  (:func:`marft_jax.bench.reference_backups.action_level_gae_reference` with ``g1_masks``);
* **update**: :class:`marft_jax.bench.update.G1Baseline`'s step (critic first, then every
  agent), on the played (step, row) pairs flattened into rows, each agent's contexts padded to
  that agent's longest (G1's ``get_token_logits`` tokenizes ``obs[:, agent_idx]`` per agent),
  actions to the token budget K, as G1's minibatch.

Token counts and FLOPs are accumulated per stage (:class:`StageWork`), summed over the forward
passes the stage runs (as our ``perf/tokens/*`` metrics sum theirs): ``valid`` = real tokens a
pass reads, ``computed`` = its padded positions, ``flops`` = analytic matmul FLOPs
(``bench/update.py``'s counting: causal attention at half the square, LM head wherever logits
are formed). The rollout counts each ``generate`` call once (prompts + generated tokens; the
prefill's padded prompts + one token per row and decode step).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from marft_jax.bench.update import G1Baseline, _body_flops, _head_flops, baseline_flops
from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import LoraStack
from marft_jax.bench.reference_backups import action_level_gae_reference
from marft_jax.rl.rollout import Generation
from marft_jax.rl.trajectory import Trajectory
from marft_jax.rl.update import UpdateBatch, UpdateConfig


@dataclasses.dataclass
class StageWork:
    """What one stage computed: token counts, analytic FLOPs, forward passes."""

    valid_tokens: int = 0
    computed_tokens: int = 0
    flops: float = 0.0
    calls: int = 0

    def add(self, valid: int, computed: int, flops: float) -> None:
        self.valid_tokens += int(valid)
        self.computed_tokens += int(computed)
        self.flops += float(flops)
        self.calls += 1


def decode_flops(cfg: ModelConfig, rows: int, prompt_len: int, steps: int,
                 keys_at: Callable[[int], int] | None = None) -> float:
    """Prefill over ``rows x prompt_len`` (causal, LM head at the last position) plus
    ``steps - 1`` decode steps of ``rows`` tokens; decode step ``t`` attends to ``keys_at(t)``
    keys (default ``prompt_len + t``: the growing context of HF's dynamic cache)."""
    flops = _body_flops(cfg, rows, prompt_len) + _head_flops(cfg, rows)
    for t in range(1, steps):
        flops += rows * cfg.flops_per_token(keys_at(t) if keys_at is not None else prompt_len + t)
    return flops


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [n, P] int64, mask [n, P] int64)``, P = the longest (G1's tokenizer padding)."""
    length = max(len(s) for s in seqs)
    ids = np.full((len(seqs), length), pad_id, np.int64)
    mask = np.zeros((len(seqs), length), np.int64)
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, length - len(s):] = s
            mask[r, length - len(s):] = 1
    return ids, mask


def _placeholder_batch(num_agents: int, act_len: int) -> UpdateBatch:
    """A one-row batch with the real action length, so :class:`G1Baseline` can be built before
    the rollout (its models serve the rollout); :meth:`G1Pipeline.load_update_data` replaces it."""
    n, k = num_agents, act_len
    z = lambda *shape: np.zeros((1, 1) + shape, np.float32)
    act_valid = np.zeros((1, 1, n, k), bool)
    act_valid[..., 0] = True
    return UpdateBatch(ctx_tokens=np.zeros((1, 1, n, 1), np.int32), ctx_valid=np.ones((1, 1, n, 1), bool),
                       act_tokens=np.zeros((1, 1, n, k), np.int32), act_valid=act_valid, logp_old=z(n, k),
                       adv=np.arange(1, n + 1, dtype=np.float32).reshape(1, 1, n), ret=z(n), v_old=z(n),
                       dp_mask=np.ones((1, 1, n), bool), feats=z(n, 1), word_count=np.ones((1, 1, n), np.int32))


class G1Pipeline(G1Baseline):
    """G1's models (one PEFT copy per agent + a critic copy) driving all three stages."""

    def __init__(self, cfg: ModelConfig, params: dict, lora: LoraStack, critic_head: dict, ucfg: UpdateConfig, *,
                 act_len: int, pad_id: int, stop_ids: Sequence[int], temperature: float, top_k: int,
                 top_p: float, no_eos: bool, seed: int = 0):
        super().__init__(cfg, params, lora, critic_head, _placeholder_batch(lora.num_agents, act_len), ucfg)
        self.cfg = cfg
        self.pad_id, self.stop_ids, self.no_eos = int(pad_id), tuple(int(i) for i in stop_ids), no_eos
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed = seed
        self.work = {"rollout": StageWork(), "values_logprobs_backup": StageWork(), "update": StageWork()}

    # ---- rollout ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], agents: np.ndarray, max_new: int, key) -> Generation:
        """HF ``generate`` with agent ``agents[0]``'s model (the sequential chain: one agent a call)."""
        torch = self.torch
        from transformers import GenerationConfig

        agent = int(agents[0])
        if not np.all(agents == agent):
            raise ValueError("the G1 pipeline generates for one agent per call (rollout.mode=sequential)")
        ids, mask = left_pad(prompts, self.pad_id)
        n, plen = ids.shape
        torch.manual_seed(self.seed + int(jax.random.randint(key, (), 0, 2 ** 30)))
        gen_cfg = GenerationConfig(do_sample=True, temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p, max_new_tokens=max_new,
                                   min_new_tokens=max_new if self.no_eos else 0,
                                   eos_token_id=None if self.no_eos else list(self.stop_ids),
                                   pad_token_id=self.pad_id, repetition_penalty=1.0)
        with torch.no_grad():
            out = self.models[agent].generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                              generation_config=gen_cfg)
        new = out[:, plen:].numpy()
        steps = new.shape[1]
        lengths = np.full((n,), steps, np.int32)
        if not self.no_eos and self.stop_ids:
            hit = np.isin(new, self.stop_ids)
            lengths = np.where(hit.any(1), hit.argmax(1) + 1, steps).astype(np.int32)
        tokens = np.full((n, max_new), self.pad_id, np.int32)
        for r in range(n):
            tokens[r, :lengths[r]] = new[r, :lengths[r]]
        self.work["rollout"].add(int(mask.sum() + lengths.sum()), n * plen + n * max(steps - 1, 0),
                                 decode_flops(self.cfg, n, plen, steps))
        return Generation(tokens=tokens, lengths=lengths, logp=np.zeros((n, max_new), np.float32))

    # ---- values, log-probs, backup ---------------------------------------------------------

    def _values(self, ctx: list[list[int]]) -> np.ndarray:
        """G1 ``get_action_values`` for one agent: a full CausalLM forward, head on the last position."""
        torch = self.torch
        ids, mask = left_pad(ctx, self.pad_id)
        with torch.no_grad():
            out = self.critic_base(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                   output_hidden_states=True, use_cache=False)
            v = self.head(out.hidden_states[-1][:, -1, :].float()).squeeze(-1)
        rows, length = ids.shape
        self.work["values_logprobs_backup"].add(int(mask.sum()), rows * length, _body_flops(self.cfg, rows, length)
                                                + _head_flops(self.cfg, rows * length))
        return v.numpy()

    def _logprobs(self, agent: int, ctx: list[list[int]], act: np.ndarray, act_len: np.ndarray) -> np.ndarray:
        """G1 ``get_joint_action_log_probs`` for one agent: rho + pi forwards, get_slice, loops."""
        torch = self.torch
        ids, mask = left_pad(ctx, self.pad_id)
        rows, length = ids.shape
        k = act.shape[1]
        act_t = torch.from_numpy(act.astype(np.int64))
        act_mask = torch.from_numpy((np.arange(k)[None, :] < act_len[:, None]).astype(np.int64))
        seq = torch.cat([torch.from_numpy(ids), act_t], -1)
        seq_mask = torch.cat([torch.from_numpy(mask), act_mask], -1)
        lens = torch.from_numpy(act_len.astype(np.int64))
        model = self.models[agent]
        with torch.no_grad():
            rho = self._get_slice(model(input_ids=seq, attention_mask=seq_mask, use_cache=False).logits, length, lens)
            del rho                                                           # G1's rho logits, unused
            pi = self._get_slice(model(input_ids=seq, attention_mask=seq_mask, use_cache=False).logits, length, lens)
            logsm = torch.log_softmax(pi, dim=-1)
            logp = np.zeros((rows,), np.float32)
            for r in range(rows):
                n = int(act_len[r])
                tok = act_t[r, :n]
                logp[r] = float(torch.gather(logsm[r, 0, :n], -1, tok[:, None]).squeeze(-1).sum())
                torch.distributions.Categorical(logits=pi[r, 0, :n]).entropy().mean()
        t = length + k
        self.work["values_logprobs_backup"].add(2 * int(mask.sum() + act_len.sum()), 2 * rows * t,
                                                2 * (_body_flops(self.cfg, rows, t) + _head_flops(self.cfg, rows * t)))
        return logp

    def prepare(self, traj: Trajectory, *, gamma: float, lam: float) -> list[UpdateBatch]:
        """Values, old log-probs and G1's backup; returns one update minibatch per played step."""
        S, B, N, L, K = traj.shape
        step_mask = np.asarray(traj.step_mask)
        ctx_tok, ctx_val = np.asarray(traj.ctx_tokens), np.asarray(traj.ctx_valid)
        act, act_valid = np.asarray(traj.act_tokens), np.asarray(traj.act_valid)
        act_len = act_valid.sum(-1)                                           # [S, B, N]
        contexts = lambda s, b, i: ctx_tok[s, b, i][ctx_val[s, b, i]].tolist()
        value = np.zeros((S, B, N), np.float32)
        logp = np.zeros((S, B, N), np.float32)
        for s in range(S):
            rows = np.flatnonzero(step_mask[s])
            if rows.size == 0:
                continue
            for i in range(N):
                ctx = [contexts(s, b, i) for b in rows]
                value[s, rows, i] = self._values(ctx)
                logp[s, rows, i] = self._logprobs(i, ctx, act[s, rows, i], act_len[s, rows, i])
        boot_valid = np.asarray(traj.boot_ctx_valid)[:, 0]                    # [B, L]: agent 0's next context
        v_boot = np.zeros((B,), np.float32)
        need = np.flatnonzero(boot_valid.any(-1))
        if need.size:
            boot = [np.asarray(traj.boot_ctx_tokens)[b, 0][boot_valid[b]].tolist() for b in need]
            v_boot[need] = self._values(boot)
        # G1's buffer: reward on the last agent of the final step, then the Python-loop backup
        dp = step_mask[:, :, None] & (act_len > 0)
        reward = np.zeros((S, B, N), np.float32)
        score = np.asarray(traj.score)
        for b in range(B):
            played = np.flatnonzero(step_mask[:, b])
            if played.size == 0:
                continue
            s_last = played[-1]
            acting = np.flatnonzero(dp[s_last, b])
            if acting.size:
                reward[s_last, b, acting[-1]] = score[s_last, b]
        adv, ret = action_level_gae_reference(reward, value, dp, step_mask, np.asarray(traj.terminal),
                                              np.asarray(traj.truncated), v_boot, gamma=gamma, lam=lam,
                                              g1_masks=True)
        # G1 plays one env step per iteration and updates on that step's rows: one minibatch per
        # step, contexts padded to that step's longest (all steps in one minibatch would pad every
        # row to the last step's contexts and hold 3x the activations: 24 GB on `reference`).
        def minibatch(pairs):
            lmax = max(int(ctx_val[s, b].sum(-1).max()) for s, b in pairs)
            R = len(pairs)
            m_ctx = np.full((1, R, N, lmax), self.pad_id, np.int32)
            m_ctx_valid = np.zeros((1, R, N, lmax), bool)
            for r, (s, b) in enumerate(pairs):
                for i in range(N):
                    c = contexts(s, b, i)
                    m_ctx[0, r, i, lmax - len(c):] = c
                    m_ctx_valid[0, r, i, lmax - len(c):] = True
            take = lambda x: np.stack([x[s, b] for s, b in pairs])[None]
            logp_tok = np.zeros((1, R, N, K), np.float32)
            logp_tok[..., 0] = take(logp)                                     # G1Baseline sums over K
            return UpdateBatch(ctx_tokens=m_ctx, ctx_valid=m_ctx_valid, act_tokens=take(act),
                               act_valid=take(act_valid), logp_old=logp_tok, adv=take(adv.astype(np.float32)),
                               ret=take(ret.astype(np.float32)), v_old=take(value), dp_mask=take(dp),
                               feats=np.zeros((1, R, N, 1), np.float32), word_count=take(np.asarray(traj.word_count)))

        return [minibatch([(s, b) for b in np.flatnonzero(step_mask[s])]) for s in range(S) if step_mask[s].any()]

    # ---- update ----------------------------------------------------------------------------

    @staticmethod
    def agent_lengths(batch: UpdateBatch) -> list[int]:
        """Each agent's padded context length in ``batch``: its longest context (left-padded)."""
        valid = np.asarray(batch.ctx_valid)[0]                               # [R, N, L]
        return [int(valid[:, i].sum(-1).max()) for i in range(valid.shape[1])]

    def load_update_data(self, batch: UpdateBatch) -> None:
        """The minibatch tensors :class:`G1Baseline` reads, agent-major (as its constructor sets
        them); the contexts as one ``[R, L_i]`` tensor per agent, padded to that agent's longest."""
        torch = self.torch
        t = lambda x, dt: torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.asarray(x)[0], 1, 0)).astype(dt))
        lengths = self.agent_lengths(batch)
        ctx, ctx_mask = t(batch.ctx_tokens, np.int64), t(batch.ctx_valid, np.int64)
        width = ctx.shape[-1]
        self.ctx = [ctx[i, :, width - n:].contiguous() for i, n in enumerate(lengths)]
        self.ctx_mask = [ctx_mask[i, :, width - n:].contiguous() for i, n in enumerate(lengths)]
        self.act, self.act_mask = t(batch.act_tokens, np.int64), t(batch.act_valid, np.int64)
        self.act_len = self.act_mask.sum(-1)
        self.logp_old = t(batch.logp_old, np.float32).sum(-1)
        self.v_old, self.ret = t(batch.v_old, np.float32), t(batch.ret, np.float32)
        adv = t(batch.adv, np.float32).numpy()
        a = adv.copy()
        a[a == 0.0] = np.nan                                                  # G1's normalization quirk
        if np.isnan(a).all():                                                 # (G1 would produce NaN here)
            a = adv
        self.adv = torch.from_numpy(((adv - np.nanmean(a)) / (np.nanstd(a) + 1e-8)).astype(np.float32))
        self.first_logp = [None] * len(self.models)

    def update(self, batches: Sequence[UpdateBatch]) -> float:
        """G1's update (:meth:`G1Baseline.step`) on each step's minibatch in turn; returns the seconds."""
        t0 = time.perf_counter()
        for batch in batches:
            self.load_update_data(batch)
            self.step()
            R, K = self.ctx[0].shape[0], self.act.shape[-1]
            lengths = [c.shape[-1] for c in self.ctx]
            ctx, act = sum(int(m.sum()) for m in self.ctx_mask), int(self.act_mask.sum())
            self.work["update"].add(ctx + 2 * (ctx + act), sum(R * (L + 2 * (L + K)) for L in lengths),
                                    sum(baseline_flops(self.cfg, R, 1, L, K) for L in lengths))
        return time.perf_counter() - t0
