"""One MARFT training iteration: rollout -> log-probs and values -> backups -> updates.

:class:`TeamLearner` binds the static pieces (model config, frozen base, tokenizer, sampler,
team, task scorer, hyper-parameters) and runs :meth:`TeamLearner.iteration` on a batch of
problems. It has no I/O: the product trainer (``marft_jax.train.trainer``) adds checkpoints,
logging and evaluation around it, and tests drive it directly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.envs.chat import ChatTokenizer
from marft_jax.envs.task import Problem, Score, Transcript
from marft_jax.models.config import ModelConfig
from marft_jax.models.placement import Placement
from marft_jax.rl import layout, packing
from marft_jax.rl import rollout as rollout_lib
from marft_jax.config import RolloutConfig
from marft_jax.rl.rollout import Generation, Team
from marft_jax.rl.state import TrainState
from marft_jax.rl.update import UpdateConfig, ppo_update
from marft_jax.sampling.prefix_reuse import PrefixStore
from marft_jax.sampling.sampler import Sampler, SamplingConfig
from marft_jax.train import host_memory
from marft_jax.train.hosts import ProcessRows, gather_trajectory
from marft_jax.train import memory_plan
from marft_jax.train import metrics as metrics_lib
from marft_jax.train.compile_count import CompileCounter, compile_metrics
from marft_jax.models.sharding import to_host
from marft_jax.rl.advantages import AdvantageConfig
from marft_jax.train.prepare import prepare_update_batch
from marft_jax.train.run_state import RunState


def interval_agent(env_samples: int, interval: int, offset: int, num_agents: int) -> int:
    """G1: ``agent_to_train = (floor(E / interval) + o) mod N``."""
    return (env_samples // interval + offset) % num_agents


def make_generate(sampler: Sampler, base, lora, sampling: SamplingConfig | RolloutConfig,
                  policy_temperature: float = 1.0, rows: ProcessRows = ProcessRows(),
                  reuse_prefix: bool = False) -> rollout_lib.GenerateFn:
    """Adapt the sampler to the rollout's ``GenerateFn`` (adapters selected per row).

    ``sampling``: the sampler's settings (``max_new_tokens``, ``temperature``, ``top_k``,
    ``top_p``), the run's rollout section or a :class:`SamplingConfig`.

    ``reuse_prefix`` (``rollout.reuse_prefix``): each call reuses the prompt K/V
    of the earlier calls of this rollout where a prompt repeats an earlier one's beginning
    (:mod:`marft_jax.sampling.prefix_reuse`).

    ``policy_temperature``: the training temperature; the sampler's log-probs and entropies at
    it are PPO's old log-probs (``prepare.py``).

    ``rows``: with several processes, each passes its own rows' prompts (possibly none); the
    sampler runs on every process's prompts concatenated in process order (the order one
    process would give them: the same per-row randomness and shapes), with the largest budget,
    and each process gets its own rows of the result (``[n_local, K]``). One process (the
    default) takes the same path: its gather is its own prompts.
    """

    # one store per rollout: the K/V it keeps belong to these weights
    store = PrefixStore() if reuse_prefix else None

    def sample(prompts, agents: np.ndarray, max_new: int, key):
        agent = int(agents[0]) if np.all(agents == agents[0]) else [int(a) for a in agents]
        return sampler(base, prompts, key=key, config=sampling, lora=lora, agent=agent,
                       budget=min(max_new, sampling.max_new_tokens), policy_temperature=policy_temperature,
                       prefix=store)

    def generate(prompts: Sequence[Sequence[int]], agents: np.ndarray, max_new: int, key) -> Generation:
        parts = rows.gather(([list(map(int, p)) for p in prompts], np.asarray(agents, np.int32), int(max_new)))
        lo = sum(len(p[0]) for p in parts[:rows.index])
        hi = lo + len(prompts)
        prompts = [p for part in parts for p in part[0]]
        agents = np.concatenate([part[1] for part in parts])
        max_new = max(part[2] for part in parts)
        out = sample(prompts, agents, max_new, key)
        cut = lambda x: None if x is None else x[lo:hi]
        return Generation(tokens=cut(out.tokens), lengths=cut(out.lengths), logp=cut(out.logps),
                          policy_logp=cut(out.policy_logps), entropy=cut(out.entropies))

    return generate


def token_counts(traj) -> tuple[int, int]:
    """(prompt tokens, generated tokens) of a trajectory, all agents and steps."""
    played = np.asarray(traj.step_mask)[:, :, None]
    ctx = int((np.asarray(traj.ctx_valid).sum(-1) * played).sum())
    return ctx, int(np.asarray(traj.act_valid).sum())


@dataclasses.dataclass(frozen=True, eq=False)     # compared and hashed by identity (it holds arrays)
class TeamLearner:
    """Static pieces of a run and the iteration that uses them.

    Frozen: what changes over a run (context bucket, packed shapes, the chosen remat) is its
    :class:`~marft_jax.train.run_state.RunState`, the one mutable object the learner holds
    (``run_state``); :meth:`iteration` and :meth:`play` update it in place, and the trainer
    saves and restores it with the train state. ``dataclasses.replace`` of a learner shares it.
    """

    cfg: ModelConfig
    base: dict
    tokenizer: ChatTokenizer
    sampler: Sampler
    team: Team
    score_fn: Callable[[Sequence[Transcript]], Sequence[Score]]
    rollout_cfg: RolloutConfig          # the rollout section: episodes and the training sampler settings
    update_cfg: UpdateConfig            # its ppo section also says which agents train when
    adv_cfg: AdvantageConfig
    # Packed sequences (rl/packing.py) for the feature pass and the update; False: the padded
    # [context bucket + K] layout (the A/B baseline of the packing).
    pack_sequences: bool = True
    # Packed rows share the prefix a (row, agent)'s later step repeats from its earlier one
    # (packing.share_prefixes; needs an attention that takes a dense mask: xla or cudnn).
    share_prefixes: bool = True
    # The run's context bucket, compiled packed shapes and remat choice (marft_jax.train.run_state).
    run_state: RunState = dataclasses.field(default_factory=RunState)
    # The run's mesh placement (marft_jax.models.placement); one device is a 1-device mesh.
    placement: Placement = dataclasses.field(default_factory=Placement.single)
    # This process's rows of every batch (marft_jax.train.hosts): with several processes,
    # play / iteration take this process's problems and return the global trajectory.
    rows: ProcessRows = dataclasses.field(default_factory=ProcessRows)

    @property
    def roles(self) -> list[str]:
        """The ``<agent>`` part of the per-agent metric names (:func:`~marft_jax.train.metrics.role_names`)."""
        return metrics_lib.role_names(self.team.num_agents, self.team.roles)

    def __post_init__(self) -> None:
        self.run_state.configure(self.cfg, self.placement.row_shards,
                                 self.adv_cfg.tokens_per_call if self.adv_cfg is not None else None)

    def play(self, state: TrainState, problems: Sequence[Problem], key,
             sampling: SamplingConfig | RolloutConfig | None = None):
        """Roll out the team on ``problems`` (no update). Returns (trajectory, texts).

        ``sampling``: other sampler settings (evaluation's temperature); None: the rollout
        section's. Old log-probs are always at the training temperature (``rollout.temperature``).

        With several processes (``self.rows``), ``problems`` are this process's rows
        (``self.rows.share`` of the batch); it builds, decodes and scores only those, and
        the texts hold only those, but the trajectory is the whole batch ``[S, B, ...]``
        (every process's rows in process order), the same on every process.
        """
        rcfg = self.rollout_cfg
        gen = make_generate(self.sampler, self.base, state.lora, sampling or rcfg, policy_temperature=rcfg.temperature,
                            rows=self.rows, reuse_prefix=rcfg.reuse_prefix)
        traj, texts = rollout_lib.rollout(problems, team=self.team, tokenizer=self.tokenizer, generate=gen,
                                          score=self.score_fn, cfg=rcfg, key=key,
                                          min_context_bucket=max(16, self.run_state.context_bucket),
                                          group=self.rows)
        traj = gather_trajectory(self.rows, traj)
        self.run_state.grow_context(traj.shape[3])
        return traj, texts

    def train_mask(self, iteration: int, env_samples: int) -> tuple[np.ndarray, bool]:
        n = self.team.num_agents
        ppo = self.update_cfg.ppo
        if ppo.agent_schedule == "interval":
            mask = np.arange(n) == interval_agent(env_samples, ppo.interval, ppo.interval_offset, n)
        else:
            mask = np.ones(n, bool)
        return mask, iteration >= ppo.critic_warmup

    def iteration(self, state: TrainState, problems: Sequence[Problem], *, iteration: int, env_samples: int,
                  key, on_stage: Callable[[str, float], None] | None = None) -> tuple[TrainState, dict, object]:
        """One iteration. Returns (new state, flat metrics dict, rollout texts); updates
        ``self.run_state`` (context bucket, packed shapes, remat choice).

        ``perf/compiles`` counts the XLA programs compiled during it (0 once every shape of
        the run has been seen), ``timing_s/compile`` the seconds they took. ``on_stage``:
        called as ``on_stage(stage name, seconds)`` after each stage (the trainer shows the
        first, compiling iteration's progress with it); None: silent.
        """
        with CompileCounter.counting() as compiles:
            state, metrics, texts = self._iteration(state, problems, iteration=iteration,
                                                    env_samples=env_samples, key=key,
                                                    report=on_stage or (lambda stage, seconds: None))
        metrics.update(compile_metrics(compiles))
        return state, metrics, texts

    def _iteration(self, state: TrainState, problems: Sequence[Problem], *, iteration: int, env_samples: int,
                   key, report: Callable[[str, float], None]) -> tuple[TrainState, dict, object]:
        timings = {}
        state = self.place_state(state)      # a no-op once placed; a fresh state would compile every program twice
        self.sampler.take_totals()
        with metrics_lib.Timer("step", timings):
            with jax.profiler.TraceAnnotation("rollout"), metrics_lib.Timer("rollout", timings) as t:
                traj, texts = self.play(state, problems, key)
            sampler_totals = self.sampler.take_totals()
            report("rollout", t.seconds)

            keep_ctx = not self.pack_sequences or (state.critic is not None and state.critic.lora is not None)
            with (jax.profiler.TraceAnnotation("prepare"), self.mesh_context(),
                  metrics_lib.Timer("values_logprobs_backup", timings) as t):
                batch, prep = prepare_update_batch(self.base, state.lora, state.critic, traj, cfg=self.cfg,
                                                   acfg=self.adv_cfg, shapes=self.run_state.prepare,
                                                   keep_contexts=keep_ctx, placement=self.placement)
                t.ready(batch.adv)
            report("critic features + backup" if state.critic is not None else "advantages", t.seconds)

            mask, train_policy = self.train_mask(iteration, env_samples)
            with (jax.profiler.TraceAnnotation("update"), self.mesh_context(),
                  metrics_lib.Timer("update", timings) as t):
                packed, pstats = self.pack_update(state, traj)
                batch, packed = self.place_update(batch, packed)
                self.check_update_memory(state, batch, packed, mask, train_policy)
                # the rollout's and any compile's freed heap go back before the update's temporaries
                host_memory.release_free_heap()
                state, upd = ppo_update(self.base, state, batch, jnp.asarray(mask), jnp.asarray(train_policy),
                                        cfg=self.cfg, ucfg=self.update_config(), packed=packed)
                t.ready(state.lora)
            host_memory.release_free_heap()          # the update's temporaries, before the next rollout
            report("update", t.seconds)

        metrics = dict(timings)
        metrics.update(prep)
        metrics.update(self.episode_metrics(traj))
        metrics["rollout/sampler_calls"] = texts.sampler_calls
        upd = to_host(upd)
        metrics.update(metrics_lib.per_agent("actor", upd["actor"], self.roles))
        for name, value in upd["critic"].items():
            metrics[f"critic/{name}"] = float(value)
        metrics["actor/trained_agents"] = int(mask.sum()) if train_policy else 0
        ctx_tok, gen_tok = token_counts(traj)
        metrics["perf/tokens/update/valid"] = pstats["valid_tokens"]
        metrics["perf/tokens/update/unique"] = pstats.get("unique_tokens", pstats["valid_tokens"])
        metrics["perf/tokens/update/computed"] = pstats["computed_tokens"]
        # prompt tokens whose K/V the sampler copied from an earlier call (rollout.reuse_prefix)
        metrics["perf/tokens/rollout/prefill_reused"] = sampler_totals.prefill_reused
        for name, slots in packing.layout_costs(np.asarray(traj.ctx_valid), np.asarray(traj.act_valid)).items():
            metrics[f"perf/tokens/update/computed_if_{name}"] = slots * self.update_cfg.ppo.epochs
        valid = metrics["perf/tokens/update/valid"] + metrics["perf/tokens/prepare/valid"]
        unique = metrics["perf/tokens/update/unique"] + metrics["perf/tokens/prepare/unique"]
        computed = metrics["perf/tokens/update/computed"] + metrics["perf/tokens/prepare/computed"]
        # slots computed per token the forwards need (padding of the packed rows), and per token
        # the sequences hold (below 1 where shared prefixes are computed once)
        metrics["perf/padding_ratio"] = computed / max(unique, 1)
        metrics["perf/computed_over_valid"] = computed / max(valid, 1)
        metrics["perf/throughput"] = (ctx_tok + gen_tok) / max(metrics["timing_s/step"], 1e-9)
        metrics["perf/rollout_tokens_per_s"] = gen_tok / max(timings["timing_s/rollout"], 1e-9)
        metrics["env_samples"] = env_samples + int(np.asarray(traj.step_mask).sum())
        played = np.asarray(traj.act_valid).any(-1)
        n = self.team.num_agents
        metrics.update(metrics_lib.utilisation_metrics(
            self.cfg, jax.tree.leaves(self.base)[0].dtype, step_s=timings["timing_s/step"],
            update_s=timings["timing_s/update"],
            context_mean=float(np.asarray(traj.ctx_valid).sum(-1)[played].mean()) if played.any() else 0.0,
            rollout_tokens=ctx_tok - sampler_totals.prefill_reused + gen_tok, rollout_head_tokens=gen_tok,
            prepare_tokens=metrics["perf/tokens/prepare/unique"],
            prepare_head_tokens=0 if self.adv_cfg.ppo.logp_old == "sampler" else gen_tok,
            update_tokens=metrics["perf/tokens/update/unique"], update_head_tokens=gen_tok * self.update_cfg.ppo.epochs,
            happo_passes=(n - 1) / n if self.update_cfg.happo_weighting and n > 1 else 0.0,
            sampler=sampler_totals,
            num_devices=self.placement.mesh.devices.size))
        return state, metrics, texts

    def update_config(self) -> UpdateConfig:
        """The update's config with the run's recorded remat choice (``model.remat`` auto only:
        an explicit policy in the config always holds)."""
        remat = self.run_state.remat_for(self.update_cfg.remat)
        return self.update_cfg if remat == self.update_cfg.remat else dataclasses.replace(self.update_cfg, remat=remat)

    def check_update_memory(self, state: TrainState, batch, packed, mask, train_policy) -> None:
        """Before the first update of each new shape: compile it (jit's cache keeps the program)
        and raise :class:`~marft_jax.train.memory_plan.MemoryPlanError`, naming the keys to
        lower, when its memory plan exceeds what the machine can give.

        With ``model.remat`` auto on an accelerator, the policies ``none``, ``dots_no_batch``
        and ``full`` are planned in that order (least recompute first) and the first that fits
        becomes the run's policy, recorded in ``run_state`` (a resumed run plans only the recorded
        one); on CPU auto stays :func:`~marft_jax.models.decoder.resolve_remat`'s row-length rule
        (``full`` costs no time there)."""
        key = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves((batch, packed)))
        if key in self.run_state.checked_updates:
            return
        s, b, n, k = batch.act_tokens.shape
        rows = "padded" if packed is None else "packed rows " + packing.format_shape(
            tuple(r.tokens.shape[-2:] for r in packed.rows))
        name = f"ppo_update (steps {s}, rows {b}, agents {n}, actions {k}, {rows})"
        remats = self.run_state.remat_candidates(self.update_cfg.remat, accelerator=jax.default_backend() != "cpu")
        candidates = [dataclasses.replace(self.update_cfg, remat=r) for r in remats]
        available = memory_plan.available_bytes()
        for i, ucfg in enumerate(candidates):
            _, planned = memory_plan.plan_of(ppo_update, self.base, state, batch, jnp.asarray(mask),
                                             jnp.asarray(train_policy), cfg=self.cfg, ucfg=ucfg, packed=packed)
            try:
                memory_plan.check_fits({f"{name}, remat {ucfg.remat or 'auto'}": planned}, available,
                                       keys_to_lower=memory_plan.UPDATE_KEYS)
                break
            except memory_plan.MemoryPlanError:
                if i == len(candidates) - 1:
                    raise
        self.run_state.choose_remat(ucfg.remat)
        self.run_state.checked_updates.add(key)

    def pack_update(self, state: TrainState, traj, policy: packing.ShapePolicy | None = None
                    ) -> tuple[packing.PackedUpdate | None, dict]:
        """The packed policy inputs of this iteration's update (None: the padded layout), and
        the valid / computed token counts of its policy forwards. ``policy``: the packed shapes
        (default: the run's, ``run_state.update``)."""
        u = self.update_cfg
        S, B, N, L, K = traj.shape
        if not self.pack_sequences:
            valid = int(np.asarray(traj.ctx_valid).sum() + np.asarray(traj.act_valid).sum())
            return None, {"valid_tokens": valid * u.ppo.epochs, "computed_tokens": S * B * N * (L + K) * u.ppo.epochs}
        perms = packing.minibatch_perms(state.rng, B, u.ppo.num_minibatches, u.ppo.epochs)
        packed, stats = packing.pack_update(np.asarray(traj.ctx_tokens), np.asarray(traj.ctx_valid),
                                          np.asarray(traj.act_tokens), np.asarray(traj.act_valid), perms,
                                          micro_batches=u.ppo.micro_batches,
                                          policy=self.run_state.update if policy is None else policy,
                                          pad_id=self.tokenizer.pad_id, share=self.share_prefixes)
        return jax.tree.map(jnp.asarray, packed), stats

    def mesh_context(self):
        """The run's mesh as JAX's context mesh (where :func:`~marft_jax.models.sharding.constrain_rows`
        applies)."""
        return jax.set_mesh(self.placement.mesh)

    def place_state(self, state: TrainState) -> TrainState:
        """The train state (LoRA stack, critic, optimizer states, RNG) replicated on the mesh, a
        fresh state as a restored checkpoint's (an uncommitted fresh state and a committed
        restored one are different jit signatures, so a run resumed in the same process would
        compile every program again)."""
        return self.placement.replicate(state)

    def place_update(self, batch, packed):
        """The update's inputs on the mesh: batch rows (and packed rows) split over the row
        shards, minibatch permutations and gather tables replicated."""
        p = self.placement
        batch = p.tree_rows(batch, layout.BATCH_AXIS)
        if packed is not None:
            packed = packed.replace(perms=p.replicate(packed.perms), gather=p.replicate(packed.gather),
                                rows=p.tree_rows(packed.rows, packing.UPDATE_ROWS_AXIS))
        return batch, packed

    def episode_metrics(self, traj) -> dict:
        """Accuracy, per-agent rewards and completion statistics of a trajectory."""
        step_mask = np.asarray(traj.step_mask)
        final_step = layout.last_played_onehot(step_mask)                      # [S, B]
        final = np.asarray(layout.at_step(traj.score, final_step))              # [B]
        final_agent_score = np.asarray(layout.at_step(traj.agent_score, final_step))   # [B, N]
        m = {"episode/accuracy": float((final >= self.rollout_cfg.success_threshold).mean()),
             "episode/score_mean": float(final.mean()),
             "episode/steps_mean": float(step_mask.sum(0).mean())}
        lengths = np.asarray(traj.act_valid).sum(-1)                             # [S, B, N]
        clipped = np.asarray(traj.budget_clipped)
        # one agent at a time: the same reductions (and float rounding) as a per-agent slice
        agents = range(self.team.num_agents)
        m.update(metrics_lib.per_agent("rewards", {"mean": [final_agent_score[:, i].mean() for i in agents]},
                                       self.roles))
        m.update(metrics_lib.per_agent("completions", {
            "mean_length": [lengths[..., i][step_mask].mean() for i in agents],
            "clipped_ratio": [clipped[..., i][step_mask].mean() for i in agents]}, self.roles))
        return m
