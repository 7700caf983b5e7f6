"""One APPO minibatch update: our jitted ``ppo_update`` vs a PyTorch + PEFT G1-style baseline.

Prints ONE JSON object. Both sides run the same model, the same shapes and the same data:
S = 1 step, ``--batch`` rows, N = ``--agents`` agents, each agent's sequence = context (``--ctx``
tokens, left-padded) ‖ action (``--act`` tokens, right-padded), LoRA r 8 / alpha 16 on q_proj and
v_proj, critic head H → 1024 → 512 → 1, one PPO epoch, one minibatch, float32 on the CPU.

**Ours** (``ppo_update``, schedule ``sequential``, HAPPO weighting on, cached critic features):
compiled ahead of time (``compile_s``), then timed over ``--repeats`` calls after
``block_until_ready``; the median is ``ours_s``. With ``--no-cache`` the same update is also timed
(interleaved with the others, own train state) with the critic features recomputed inside the
jitted call (one base forward over every context, as a critic without the cache needs each
epoch): ``ours_no_cache_s``. ``feature_cache_saving_s``
is always reported: the time of that critic-feature forward alone (what the cache saves per
epoch; the features themselves are computed once per rollout, next to ``logp_old``).

**Baseline** (the reference G1, ``marft/algorithms/appo_trainer.py`` + ``marft/mas/mas.py``):

* one full base copy per agent, each wrapped by ``peft.get_peft_model`` (G1's ``Agent``), plus
  one more copy for the critic (G1's ``ActionCritic``), quirk 1;
* critic step first: for each agent, a no-grad ``AutoModelForCausalLM`` forward over its
  context with ``output_hidden_states=True`` (the LM head runs too, as in G1), the MLP head on
  the last hidden state at the last context token, clipped Huber value loss, backward, grad
  clip 0.5, Adam;
* then for each agent: a no-grad forward whose logits are sliced and discarded (quirk 2), the
  grad forward, G1's ``get_slice`` copy into a zero ``[B, 1, K, V]`` fp32 tensor, full-vocabulary
  ``log_softmax`` (quirk 3), per-row gather / ``Categorical`` entropy loops, the APPO clipped loss
  with entropy, backward, grad clip 0.5, AdamW step.

G1 with ``agent_iteration_interval`` trains one agent per update; here every agent is updated
in each call (the computation ours does). Baseline and ours are interleaved repeat by repeat
so that load from other processes hits both alike; medians are reported.

FLOPs: analytic matmul FLOPs of what each side computes (causal attention counted at half the
square), divided by the median time, and compared with a large float32 matmul timed in the
same run, before and after the timed loop, best of the two (``jnp`` for ours, ``torch`` for the
baseline). ``flops_ratio`` (baseline FLOPs / ours) times ``flop_rate_ratio`` (our FLOP/s / the
baseline's) equals ``ratio``: the first part is work we do not do (one policy forward per
evaluation, the LM head only at the K predicting positions, no critic forward, no HAPPO forward
for the last agent), the second how fast each side runs its FLOPs.

Usage::

    python -m marft_jax.bench.update                          # SmolLM2-135M, 8 rows x (128 + 128)
    python -m marft_jax.bench.update --model random-135m      # random weights, same shape
    python -m marft_jax.bench.update --model tiny-test --repeats 1   # seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import dataclasses
import platform
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.bench.machine import cpu_model, torch_matmul_flops
from marft_jax.bench.sampler import matmul_roofline_flops
from marft_jax.config import AlgoConfig, LoraConfig, OptimConfig, PPOConfig
from marft_jax.models import causal_attention, decoder, logprobs as lp_lib
from marft_jax.models.config import ModelConfig
from marft_jax.models.critic import critic_features_fn, padded_critic_features, value_head
from marft_jax.models.lora import LoraStack
from marft_jax.rl.update import UpdateBatch, UpdateConfig, ppo_update
from marft_jax.rl.state import TrainState, init_train_state

SMOLLM2_135M_SHAPE = dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,))
TINY_TEST_SHAPE = dict(arch="llama", vocab_size=257, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=512)
LORA = LoraConfig(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))


# ----------------------------------------------------------------------------------------------
# Model, data, FLOPs.


def load(name: str, seed: int = 0) -> tuple[ModelConfig, dict, str]:
    """``(cfg, float32 params, what was loaded)``; a random same-shape model if loading fails."""
    if name == "tiny-test":
        cfg = ModelConfig(**TINY_TEST_SHAPE)
        return cfg, decoder.init_params(jax.random.key(seed), cfg, std=0.2), "random tiny-test"
    if name == "random-135m":
        cfg = ModelConfig(**SMOLLM2_135M_SHAPE)
        return cfg, decoder.init_params(jax.random.key(seed), cfg), "random (SmolLM2-135M shape)"
    try:
        from marft_jax.models.registry import load_model

        m = load_model(name, dtype=jnp.float32)
        return m.cfg, m.params, m.source
    except Exception as e:  # noqa: BLE001 - speed does not depend on the weight values
        cfg = ModelConfig(**SMOLLM2_135M_SHAPE)
        return (cfg, decoder.init_params(jax.random.key(seed), cfg),
                f"random (SmolLM2-135M shape; loading {name!r} failed: {type(e).__name__}: {e})")


def make_batch(cfg: ModelConfig, rows: int, agents: int, ctx_len: int, act_len: int, seed: int,
               base, state: TrainState) -> UpdateBatch:
    """Random left-padded contexts and right-padded actions (lengths in [len/2, len]), with
    ``logp_old`` from the current policy (ratio 1, so the KL stop never skips) and the critic
    feature cache from one base forward, as ``train/prepare.py`` computes them."""
    rng = np.random.default_rng(seed)
    S, B, N, L, K = 1, rows, agents, ctx_len, act_len
    ctx = rng.integers(3, cfg.vocab_size, (S, B, N, L)).astype(np.int32)
    ctx_valid = np.arange(L) >= L - rng.integers(max(L // 2, 1), L + 1, (S, B, N, 1))
    act = rng.integers(3, cfg.vocab_size, (S, B, N, K)).astype(np.int32)
    act_lens = rng.integers(max(K // 2, 1), K + 1, (S, B, N))
    act_valid = np.arange(K) < act_lens[..., None]
    flat = lambda x: jnp.asarray(x.reshape((S * B * N,) + x.shape[3:]))
    agent_ids = jnp.asarray(np.broadcast_to(np.arange(N, dtype=np.int32), (S, B, N)).reshape(-1))
    logp, _ = lp_lib.action_logprobs(base, state.lora, agent_ids, flat(ctx), flat(ctx_valid), flat(act),
                                     flat(act_valid), 1.0, cfg=cfg)
    feats = padded_critic_features(base, flat(ctx), flat(ctx_valid), flat(act), flat(act_valid), cfg=cfg,
                                   token_level=False)
    dp = act_valid.any(-1)
    v_old = value_head(state.critic.head, feats).reshape(S, B, N)
    adv = np.where(dp, rng.normal(size=dp.shape), 0).astype(np.float32)
    ret = np.where(dp, np.asarray(v_old) + rng.normal(size=dp.shape), 0).astype(np.float32)
    return UpdateBatch(ctx_tokens=jnp.asarray(ctx), ctx_valid=jnp.asarray(ctx_valid), act_tokens=jnp.asarray(act),
                       act_valid=jnp.asarray(act_valid), logp_old=jnp.asarray(logp).reshape(S, B, N, K),
                       adv=jnp.asarray(adv), ret=jnp.asarray(ret), v_old=jnp.where(dp, v_old, 0.0),
                       dp_mask=jnp.asarray(dp), feats=feats.reshape(S, B, N, -1),
                       word_count=jnp.asarray(act_lens.astype(np.int32)))


def _body_flops(cfg: ModelConfig, rows: int, t: int) -> float:
    """Decoder-block matmul FLOPs of a forward over ``rows x t`` tokens (causal attention: t/2
    keys on average), without the LM head."""
    return rows * t * (cfg.flops_per_token(t // 2) - 2.0 * cfg.hidden_size * cfg.vocab_size)


def _head_flops(cfg: ModelConfig, tokens: int) -> float:
    return 2.0 * tokens * cfg.hidden_size * cfg.vocab_size


def ours_flops(cfg: ModelConfig, rows: int, agents: int, L: int, K: int, happo_forwards: int) -> float:
    """Per agent: loss forward (blocks over L+K, LM head over the K predicting positions), its
    backward (input gradients only, the base is frozen: 1x the blocks; the chunked head is
    recomputed and back-propagated: 2x), plus ``happo_forwards`` no-grad forwards in total."""
    body, head = _body_flops(cfg, rows, L + K), _head_flops(cfg, rows * K)
    return agents * (2 * body + 3 * head) + happo_forwards * (body + head)


def baseline_flops(cfg: ModelConfig, rows: int, agents: int, L: int, K: int) -> float:
    """Per agent: critic CausalLM forward over the context (LM head on every position), two
    policy forwards over L+K (LM head on every position), backward of one (input gradients)."""
    T = L + K
    critic = _body_flops(cfg, rows, L) + _head_flops(cfg, rows * L)
    fwd = _body_flops(cfg, rows, T) + _head_flops(cfg, rows * T)
    return agents * (critic + 3 * fwd)


# ----------------------------------------------------------------------------------------------
# Ours.


class Ours:
    """The jitted update, compiled ahead of time; ``step()`` runs one update and blocks."""

    def __init__(self, cfg, base, state, batch, ucfg: UpdateConfig, recompute_feats: bool = False):
        self.base, self.state, self.batch = base, state, batch
        n = batch.ctx_tokens.shape[2]
        self.args = (jnp.ones((n,), bool), jnp.asarray(True))
        if recompute_feats:
            def fn(base, state, batch, train_mask, train_policy):
                s, b, n_, l = batch.ctx_tokens.shape
                flat = lambda x: x.reshape((s * b * n_,) + x.shape[3:])
                feats = critic_features_fn(base, flat(batch.ctx_tokens), flat(batch.ctx_valid),
                                           flat(batch.act_tokens), flat(batch.act_valid), cfg=cfg,
                                           token_level=ucfg.token_level)
                batch = batch.replace(feats=feats.reshape(batch.feats.shape))
                return ppo_update(base, state, batch, train_mask, train_policy, cfg=cfg, ucfg=ucfg)
            jitted = jax.jit(fn, donate_argnums=(1,))
            lowered = jitted.lower(base, state, batch, *self.args)
        else:
            lowered = ppo_update.lower(base, state, batch, *self.args, cfg=cfg, ucfg=ucfg)
        t0 = time.perf_counter()
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - t0
        self.metrics = None

    def step(self) -> float:
        t0 = time.perf_counter()
        self.state, self.metrics = self.compiled(self.base, self.state, self.batch, *self.args)
        jax.block_until_ready((self.state, self.metrics))
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# The G1-style PyTorch + PEFT baseline.


class G1Baseline:
    """G1's APPO update in PyTorch + PEFT (float32, CPU); see the module docstring."""

    def __init__(self, cfg: ModelConfig, params: dict, lora: LoraStack, critic_head: dict,
                 batch: UpdateBatch, ucfg: UpdateConfig, shared_base: bool = False):
        import torch
        from peft import LoraConfig as PeftLoraConfig, get_peft_model

        from marft_jax.bench.sampler import hf_model_from_params
        from marft_jax.models import peft_io

        self.torch = torch
        self.ucfg = ucfg
        self.shared_base = shared_base
        base = hf_model_from_params(cfg, params)
        for p in base.parameters():
            p.requires_grad_(False)
        n = lora.num_agents
        self.roles = [f"agent{i}" for i in range(n)]
        pcfg = PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.targets),
                              lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")

        def load_adapter(model, i, name):
            sd = {}
            for t in lora.targets:
                a, b = np.asarray(lora.a[t][i]), np.asarray(lora.b[t][i])
                mod = peft_io.peft_module_path(t)
                for layer in range(a.shape[0]):
                    pre = f"base_model.model.model.layers.{layer}.{mod}"
                    sd[f"{pre}.lora_A.{name}.weight"] = torch.from_numpy(a[layer].T.copy())
                    sd[f"{pre}.lora_B.{name}.weight"] = torch.from_numpy(b[layer].T.copy())
            missing = set(sd) - set(model.state_dict())
            if missing:
                raise RuntimeError(f"PEFT keys not found: {sorted(missing)[:3]}")
            model.load_state_dict(sd, strict=False)

        if shared_base:  # one base, one adapter per agent, switched with set_adapter
            pm = get_peft_model(copy.deepcopy(base), pcfg, adapter_name=self.roles[0])
            for name in self.roles[1:]:
                pm.add_adapter(name, pcfg)
            for i, name in enumerate(self.roles):
                load_adapter(pm, i, name)
            pm.train()
            self.models = [pm] * n
        else:  # G1: every Agent loads its own base model
            self.models = []
            for i in range(n):
                pm = get_peft_model(copy.deepcopy(base), pcfg)
                load_adapter(pm, i, "default")
                pm.base_model.model.enable_input_require_grads()
                pm.train()
                self.models.append(pm)
        self.critic_base = base.train()                                   # the critic's own copy
        h = cfg.hidden_size
        self.head = torch.nn.Sequential(torch.nn.Linear(h, 1024, bias=False), torch.nn.ReLU(),
                                        torch.nn.Linear(1024, 512, bias=False), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 1, bias=False))
        with torch.no_grad():
            self.head[0].weight.copy_(torch.from_numpy(np.asarray(critic_head["w1"]).T.copy()))
            self.head[2].weight.copy_(torch.from_numpy(np.asarray(critic_head["w2"]).T.copy()))
            self.head[4].weight.copy_(torch.from_numpy(np.asarray(critic_head["w3"])[None].copy()))
        eps = ucfg.optim.eps
        self.critic_opt = torch.optim.Adam(self.head.parameters(), lr=ucfg.optim.critic_lr, eps=eps)
        self.policy_opts = []
        for i, pm in enumerate(self.models):
            if shared_base:
                params_i = [p for nme, p in pm.named_parameters() if f".{self.roles[i]}." in nme]
            else:
                params_i = [p for p in pm.parameters() if p.requires_grad]
            self.policy_opts.append((params_i, torch.optim.AdamW(params_i, lr=ucfg.optim.policy_lr,
                                                                   eps=eps, weight_decay=0.0)))
        # data, agent-major: [N, B, ...]
        t = lambda x, dt: torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.asarray(x)[0], 1, 0)).astype(dt))
        self.ctx = t(batch.ctx_tokens, np.int64)
        self.ctx_mask = t(batch.ctx_valid, np.int64)
        self.act = t(batch.act_tokens, np.int64)
        self.act_mask = t(batch.act_valid, np.int64)
        self.act_len = self.act_mask.sum(-1)                              # [N, B]
        self.logp_old = t(batch.logp_old, np.float32).sum(-1)             # [N, B] action log-probs
        self.v_old = t(batch.v_old, np.float32)
        self.ret = t(batch.ret, np.float32)
        adv = t(batch.adv, np.float32).numpy()
        # G1's normalization (exact zeros dropped), once per minibatch over all agents
        a = adv.copy()
        a[a == 0.0] = np.nan
        self.adv = torch.from_numpy((adv - np.nanmean(a)) / (np.nanstd(a) + 1e-8))
        self.first_logp: list[Any] = [None] * n                          # per agent, first call
        self.breakdown: dict[str, list[float]] = {"critic_s": [], "policy_forwards_s": [],
                                                  "logsoftmax_loss_s": [], "backward_step_s": []}

    def _huber(self, e, d):
        torch = self.torch
        return torch.where(e.abs() <= d, e ** 2 / 2, d * (e.abs() - d / 2))

    def _get_slice(self, logits, L: int, act_len):
        """G1 ``MAS.get_slice`` for one agent: Python loop copying each row into ``[B, 1, K, V]``."""
        torch = self.torch
        B, K = act_len.shape[0], self.act.shape[-1]
        out = torch.zeros(B, 1, K, logits.shape[-1])
        for r in range(B):
            n = int(act_len[r])
            out[r, 0, :n] = logits[r, L - 1:L - 1 + n].clone()
        return out

    def step(self) -> float:
        torch = self.torch
        u = self.ucfg.ppo
        N, B = len(self.ctx), self.ctx[0].shape[0]      # ctx: [N, B, L], or per agent [B, L_i]
        bd = {k: 0.0 for k in self.breakdown}
        t_start = time.perf_counter()
        # ---- critic: a full base forward per agent (no grad), head + value loss, Adam
        t0 = time.perf_counter()
        self.critic_opt.zero_grad()
        values = []
        for i in range(N):
            with torch.no_grad():
                out = self.critic_base(self.ctx[i], attention_mask=self.ctx_mask[i], output_hidden_states=True,
                                       use_cache=False)
            h = out.hidden_states[-1][:, -1, :].float()
            values.append(self.head(h).squeeze(-1))
        v = torch.stack(values)                                            # [N, B]
        v_clip = self.v_old + (v - self.v_old).clamp(-u.value_clip_eps, u.value_clip_eps)
        vl = torch.max(self._huber(self.ret - v_clip, u.huber_delta), self._huber(self.ret - v, u.huber_delta))
        (vl.mean() * u.vf_coef).backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), u.critic_max_grad_norm)
        self.critic_opt.step()
        bd["critic_s"] += time.perf_counter() - t0
        # ---- policies, agent by agent
        for i, pm in enumerate(self.models):
            t0 = time.perf_counter()
            if self.shared_base:
                pm.set_adapter(self.roles[i])
            params_i, opt = self.policy_opts[i]
            opt.zero_grad()
            L = self.ctx[i].shape[-1]
            ids = torch.cat([self.ctx[i], self.act[i]], -1)
            mask = torch.cat([self.ctx_mask[i], self.act_mask[i]], -1)
            with torch.no_grad():                                          # G1's rho logits, discarded
                rho = pm(input_ids=ids, attention_mask=mask, use_cache=False).logits
                _ = self._get_slice(rho, L, self.act_len[i])
                del rho, _
            pi = pm(input_ids=ids, attention_mask=mask, use_cache=False).logits
            pi = self._get_slice(pi, L, self.act_len[i])                   # [B, 1, K, V]
            t1 = time.perf_counter()
            bd["policy_forwards_s"] += t1 - t0
            logsm = torch.log_softmax(pi, dim=-1)
            logp = torch.empty(B)
            ent = torch.empty(B)
            for r in range(B):
                n = int(self.act_len[i, r])
                tok = self.act[i, r, :n]
                logp[r] = torch.gather(logsm[r, 0, :n], -1, tok[:, None]).squeeze(-1).sum()
                ent[r] = torch.distributions.Categorical(logits=pi[r, 0, :n]).entropy().mean()
            if self.first_logp[i] is None:
                self.first_logp[i] = logp.detach().numpy().copy()
            log_ratio = logp - self.logp_old[i]
            ratio = torch.exp(log_ratio)
            adv = self.adv[i]
            surr = torch.max(-torch.clamp(ratio, 1 - u.clip_eps, 1 + u.clip_eps) * adv, -ratio * adv)
            loss = surr.mean() - u.ent_coef * ent.mean()
            t2 = time.perf_counter()
            bd["logsoftmax_loss_s"] += t2 - t1
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params_i, u.max_grad_norm)
            opt.step()
            del pi, logsm, loss
            bd["backward_step_s"] += time.perf_counter() - t2
        for k, x in bd.items():
            self.breakdown[k].append(x)
        return time.perf_counter() - t_start


# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (embedded), 'random-135m', 'tiny-test', an HF dir or a .gguf")
    p.add_argument("--batch", type=int, default=8, help="rows per agent (one minibatch)")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--ctx", type=int, default=128, help="context length L")
    p.add_argument("--act", type=int, default=128, help="action length K")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per side (median)")
    p.add_argument("--chunk", type=int, default=128, help="log-prob chunk (positions)")
    p.add_argument("--remat", nargs="?", const="full", default=False, choices=list(decoder.REMAT_POLICIES),
                   help="ours: rematerialize decoder blocks (alone: full; or a model.remat policy name)")
    p.add_argument("--causal-attention", default="auto", choices=["auto", "xla", "native"],
                   help="ours: whole-row attention (model.causal_attention)")
    p.add_argument("--no-happo", action="store_true", help="ours: happo_weighting off")
    p.add_argument("--no-cache", action="store_true",
                   help="ours: also time the update with the critic features recomputed inside it")
    p.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--baseline-shared-base", action="store_true",
                   help="baseline: one base with one PEFT adapter per agent (set_adapter) instead "
                        "of G1's base copy per agent")
    p.add_argument("--roofline-n", type=int, default=2048, help="matmul size of the roofline")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: os.cpu_count())")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    cores = os.cpu_count() or 1
    cfg, params, source = load(args.model, args.seed)
    cfg = dataclasses.replace(cfg, causal_attention=causal_attention.resolve(args.causal_attention, dtype=jnp.float32,
                                                                             key="--causal-attention"))
    base = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    N, B, L, K = args.agents, args.batch, args.ctx, args.act
    optim = OptimConfig()
    ucfg = UpdateConfig(ppo=PPOConfig(agent_schedule="sequential", happo_weighting=not args.no_happo, epochs=1,
                                      num_minibatches=1, micro_batches=1),
                        algo=AlgoConfig(level="action"), optim=optim, chunk=args.chunk, remat=args.remat)
    state = init_train_state(jax.random.key(args.seed + 1), cfg, LORA, N, optim)
    batch = make_batch(cfg, B, N, L, K, args.seed, base, state)
    lora0 = jax.tree.map(np.array, state.lora)                             # copies: state is donated
    head0 = jax.tree.map(np.array, state.critic.head)
    logp_old_np = np.asarray(batch.logp_old).sum(-1)[0]                    # [B, N]

    jax_roof = [matmul_roofline_flops(args.roofline_n)]
    baseline = None
    torch_roof: list[float] = []
    if not args.no_baseline:
        import torch

        torch.set_num_threads(args.torch_threads or cores)
        baseline = G1Baseline(cfg, params, lora0, head0, batch, ucfg, shared_base=args.baseline_shared_base)
        torch_roof.append(torch_matmul_flops(args.roofline_n))

    ours = Ours(cfg, base, state, batch, ucfg)
    no_cache = None
    if args.no_cache:  # its own (identical) train state: ``ours`` donates its state
        state_nc = init_train_state(jax.random.key(args.seed + 1), cfg, LORA, N, optim)
        no_cache = Ours(cfg, base, state_nc, batch, ucfg, recompute_feats=True)
    t0 = time.perf_counter()
    ours.step()                                                            # first run (warm-up)
    first_run_s = time.perf_counter() - t0
    for side in (no_cache, baseline):
        if side is not None:
            side.step()                                                    # warm-up
    ours_t, nc_t, base_t = [], [], []
    for _ in range(args.repeats):                     # interleaved: outside load hits every side alike
        ours_t.append(ours.step())
        if no_cache is not None:
            nc_t.append(no_cache.step())
        if baseline is not None:
            base_t.append(baseline.step())
    ours_s = statistics.median(ours_t)

    # the critic-feature forward the cache saves every epoch (all agents' contexts)
    s_, b_, n_, l_ = batch.ctx_tokens.shape
    flat = lambda x: x.reshape((s_ * b_ * n_,) + x.shape[3:])
    feat_args = (base, flat(batch.ctx_tokens), flat(batch.ctx_valid), flat(batch.act_tokens), flat(batch.act_valid))
    jax.block_until_ready(padded_critic_features(*feat_args, cfg=cfg, token_level=False))
    feat_t = []
    for _ in range(max(args.repeats, 3)):
        t0 = time.perf_counter()
        jax.block_until_ready(padded_critic_features(*feat_args, cfg=cfg, token_level=False))
        feat_t.append(time.perf_counter() - t0)
    jax_roof.append(matmul_roofline_flops(args.roofline_n))                     # again, after the load
    if baseline is not None:
        torch_roof.append(torch_matmul_flops(args.roofline_n))

    # update_agents skips the last agent's HAPPO forward (nothing after it reads the factor)
    happo_forwards = N - 1 if ucfg.happo_weighting else 0
    jax_roof_best = max(jax_roof)
    flops = ours_flops(cfg, B, N, L, K, happo_forwards)
    report: dict[str, Any] = {
        "bench": "update",
        "model": args.model,
        "model_source": source,
        "shapes": {"steps": 1, "rows": B, "agents": N, "ctx_len": L, "act_len": K, "seq_len": L + K,
                   "vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "layers": cfg.num_layers,
                   "lora": {"rank": LORA.rank, "alpha": LORA.alpha, "targets": list(LORA.targets)},
                   "critic_head": [cfg.hidden_size, 1024, 512, 1]},
        "update": {"level": "action", "schedule": ucfg.agent_schedule, "happo_weighting": ucfg.happo_weighting,
                   "epochs": 1, "num_minibatches": 1, "chunk": ucfg.chunk, "remat": ucfg.remat,
                   "dtype": "float32", "causal_attention": cfg.causal_attention},
        "tokens_per_update": N * B * (L + K),
        "repeats": args.repeats,
        "ours_s": ours_s,
        "ours_times_s": ours_t,
        "compile_s": ours.compile_s,
        "first_run_s": first_run_s,
        "feature_cache_saving_s": statistics.median(feat_t),
        "ours_model_flops": flops,
        "ours_flops_per_s": flops / ours_s,
        "jax_matmul_roofline_flops_per_s": jax_roof_best,
        "jax_matmul_roofline_samples": jax_roof,
        "ours_mfu": flops / ours_s / jax_roof_best,
        "ours_metrics": {k: np.asarray(v).tolist() for k, v in ours.metrics["actor"].items()
                         if k in ("pg_loss", "approx_kl", "updated", "happo_factor")},
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "cpu_cores": cores,
        "machine": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if baseline is not None:
        import torch

        baseline_s = statistics.median(base_t)
        bflops = baseline_flops(cfg, B, N, L, K)
        report.update({
            "baseline_s": baseline_s,
            "baseline_times_s": base_t,
            "ratio": baseline_s / ours_s,
            "ratio_best": min(base_t) / min(ours_t),                       # outside load only adds time
            "baseline_desc": ("PyTorch+PEFT G1 style: " + ("one base, adapters via set_adapter"
                              if args.baseline_shared_base else "one base copy per agent + one for the critic")
                              + "; critic CausalLM forward per agent each epoch; 2 policy forwards per agent "
                              "(1 discarded); fp32 [B,1,K,V] log_softmax; AdamW / Adam"),
            "baseline_breakdown_s": {k: statistics.median(v[1:] or v) for k, v in baseline.breakdown.items()},
            "baseline_model_flops": bflops,
            "baseline_flops_per_s": bflops / baseline_s,
            "torch_matmul_roofline_flops_per_s": max(torch_roof),
            "torch_matmul_roofline_samples": torch_roof,
            "baseline_mfu": bflops / baseline_s / max(torch_roof),
            # the speed-up split: FLOPs we do not compute x faster FLOPs (backend, fusion, no copies)
            "flops_ratio": bflops / flops,
            "flop_rate_ratio": (flops / ours_s) / (bflops / baseline_s),
            # the baseline's first log-probs (initial adapters) against our logp_old: same model?
            "logp_parity_max_abs": float(np.max(np.abs(np.stack(baseline.first_logp, 1) - logp_old_np))),
            "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        })
    if no_cache is not None:
        report["ours_no_cache_s"] = statistics.median(nc_t)
        report["ours_no_cache_times_s"] = nc_t
        report["no_cache_compile_s"] = no_cache.compile_s
        report["no_cache_minus_cache_s"] = report["ours_no_cache_s"] - ours_s
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
