"""Build a run's pieces from a :class:`~marft_jax.config.Config`: model, tokenizer, task, team,
sampler, scorer and the learner, so ``train``, ``eval`` and ``generate`` share one code path."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from marft_jax import distributed
from marft_jax.config import Config, ConfigError
from marft_jax.envs import profiles as profiles_lib
from marft_jax.envs.chat import HFChatTokenizer
from marft_jax.envs.scoring_pool import ScoringPool
from marft_jax.envs.task import Task
from marft_jax.models import attention as attention_lib
from marft_jax.models import cache_attention, causal_attention, layer_matmul, quant_matmul
from marft_jax.models import lora, registry, sharding
from marft_jax.models.placement import Placement
from marft_jax.rl import advantages, topology
from marft_jax.rl.advantages import AdvantageConfig
from marft_jax.rl.rollout import Team
from marft_jax.rl.state import TrainState, init_train_state
from marft_jax.rl.update import UpdateConfig
from marft_jax.sampling.sampler import Sampler
from marft_jax.train.hosts import ProcessRows
from marft_jax.train.iteration import TeamLearner
from marft_jax.train.metric_sinks import check_loggers


def check_names(cfg: Config) -> Config:
    """The keys whose values are a registry's names, each checked beside its registry (the LoRA
    targets, the team graphs and their links, the metric sinks); :func:`marft_jax.config.validate`
    checks the rest when the config is loaded. Raises :class:`ConfigError` naming the key; cheap,
    so every entry point calls it before any work (``build_team``, ``build_run``, ``train``, the CLI)."""
    lora.check_targets(cfg.lora.targets)
    topology.check_team_keys(cfg.team.graph, cfg.team.layer_links, cfg.rollout.mode)
    check_loggers(cfg.train.loggers, cfg.train.wandb.mode)
    check_estimator(cfg)
    return cfg


def fresh_state(cfg: Config, model_cfg, seed: int | None = None) -> TrainState:
    """A fresh train state for the run (``seed``: default ``train.seed``): adapters for every
    agent, and the critic only when ``algo.advantage`` reads one."""
    return init_train_state(jax.random.key(cfg.train.seed if seed is None else seed), model_cfg, cfg.lora,
                            cfg.team.num_agents, cfg.optim, critic_lora=cfg.ppo.critic_lora,
                            critic=advantages.needs_critic(cfg.algo))


def check_estimator(cfg: Config) -> None:
    """``algo.advantage`` is a registered estimator, and a critic-free one is not asked to train a
    critic (``ppo.critic_warmup``, ``ppo.critic_lora``) or to baseline groups of one."""
    if advantages.needs_critic(cfg.algo):
        return
    name = cfg.algo.advantage
    if cfg.ppo.critic_warmup:
        raise ConfigError(f"ppo.critic_warmup={cfg.ppo.critic_warmup}: must be 0 with algo.advantage={name!r} "
                          "(a critic-free estimator: the run has no critic)")
    if cfg.ppo.critic_lora:
        raise ConfigError(f"ppo.critic_lora=true: not with algo.advantage={name!r} (a critic-free estimator)")
    if name == "group" and cfg.rollout.group_size < 2:
        raise ConfigError(f"rollout.group_size={cfg.rollout.group_size}: must be >= 2 with algo.advantage=group "
                          "(each problem's episodes are baselined by their group's mean)")


def build_task(cfg: Config) -> Task:
    """The task named by ``task.name`` (errors name the key). Without ``task.path`` the named
    Hub tasks (math, math500, gsm8k, aime, humaneval) read their pinned Hub datasets
    (:mod:`marft_jax.data.hub_datasets`); ``task.path`` / ``task.eval_path`` override them."""
    from marft_jax.data import hub_datasets

    t = cfg.task
    if t.name == "arithmetic":
        from marft_jax.envs.arithmetic import ArithmeticTask

        return ArithmeticTask(t.level, n_train=t.train_size, n_test=t.test_size, data_seed=0)
    for key in ("task.path", "task.eval_path"):
        value = getattr(t, key.split(".")[1])
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{key} {value!r} does not exist")
    if t.name == "humaneval":
        from marft_jax.envs.code_task import humaneval_task

        path = t.path or str(hub_datasets.hub_file("humaneval", "test")[1])
        return humaneval_task(path=path, code_reward=t.code_reward)
    if t.path is None and t.name in hub_datasets.HUB_TASKS:
        from marft_jax.data.datasets import load_problems
        from marft_jax.envs.math_task import MathTask

        kwargs = {k: v for k, v in (("problem_field", t.problem_field), ("answer_field", t.answer_field)) if v}
        train = hub_datasets.hub_problems(t.name, "train")
        test = (load_problems(t.eval_path, **kwargs) if t.eval_path
                else hub_datasets.hub_problems(t.name, "test"))
        return MathTask(t.name, train, test)
    if t.path is None:
        raise ConfigError(f"task.path is required for task.name={t.name!r} (Hub datasets are pinned "
                          f"for {', '.join(hub_datasets.HUB_TASKS)})")
    if t.name == "code_jsonl":
        from marft_jax.envs.code_task import stdio_task

        return stdio_task(t.name, train_path=t.path, test_path=t.eval_path, code_reward=t.code_reward)
    from marft_jax.envs.math_task import MathTask

    load_kwargs = {k: v for k, v in (("problem_field", t.problem_field), ("answer_field", t.answer_field)) if v}
    if t.eval_path:
        return MathTask.from_files(t.name, t.path, t.eval_path, load_kwargs=load_kwargs)
    return MathTask.from_split(t.name, t.path, load_kwargs=load_kwargs)


def build_team(cfg: Config) -> Team:
    check_names(cfg)
    prof = profiles_lib.validate(profiles_lib.load_profiles(cfg.team.profile), cfg.team.num_agents)
    answer = cfg.team.answer_agent if cfg.team.answer_agent is not None else prof.answer_agent
    graph = topology.resolve(cfg.team.graph, roles=prof.roles, answer_agent=answer, profile_parents=prof.parents,
                             num_agents=cfg.team.num_agents, mode=cfg.rollout.mode,
                             source=f"team.graph (profile {prof.name!r})")
    if cfg.ppo.critic_lora and graph.critic_reads_all_earlier(cfg.team.layer_links):
        raise ConfigError(f"ppo.critic_lora is not supported with the team graph of profile {prof.name!r} "
                          f"(team.graph={cfg.team.graph!r}): its critic reads the joint history, which the "
                          "critic-LoRA update does not carry yet; use the chain or independent graph, "
                          "team.layer_links=layer, or ppo.critic_lora=false")
    if cfg.algo.reference_semantics and graph.links(1, cfg.team.layer_links).kind == "table":
        raise ConfigError(f"algo.reference_semantics (G1's chained masks) needs chained links, but "
                          f"team.layer_links={cfg.team.layer_links!r} on the team graph of profile {prof.name!r} "
                          "links the agents of a layer to a shared successor; set one of them back")
    if cfg.algo.reference_semantics and graph.independent:
        raise ConfigError(f"algo.reference_semantics (G1's chained masks) needs chained links, but the "
                          f"independent graph (team.graph={cfg.team.graph!r}, rollout.mode={cfg.rollout.mode!r}) "
                          "links each agent to itself; set one of them back")
    return Team(roles=prof.roles, system_prompts=prof.system_prompts, answer_agent=answer, topology=graph,
                layer_links=cfg.team.layer_links)


def model_dtype(cfg: Config):
    if cfg.model.dtype == "auto":
        return None
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cfg.model.dtype]


def share_prefixes(cfg: Config, attention: str) -> bool:
    """``ppo.share_prefixes`` as the resolved ``attention`` allows it. Shared-prefix branches need a
    dense mask (``xla``, ``cudnn``); the Pallas and splash kernels take a static causal mask plus
    segment ids only, so there it is switched off with a warning (each sequence then packs its
    whole context: more slots, measured in docs/accelerators.md)."""
    if cfg.ppo.share_prefixes and attention not in ("xla", "cudnn"):
        logging.getLogger(__name__).warning(
            "ppo.share_prefixes is switched off: model.attention=%s (%s) takes segment ids only, not the "
            "shared-prefix branches; each sequence packs its whole context instead (more slots)",
            attention, cfg.model.attention)
        return False
    return cfg.ppo.share_prefixes


def remat_policy(cfg: Config) -> str | None:
    """``model.remat`` as a policy name (None: auto); ``true``/``false`` read as ``full``/``none``."""
    r = cfg.model.remat
    if r is None:
        return None
    return {"true": "full", "false": "none"}.get(str(r).lower(), str(r))


def update_config(cfg: Config, graph: topology.Topology | None = None) -> UpdateConfig:
    """The update's sections, the run's optimizer-step count (the cosine schedule's length), the
    remat policy and the team graph's layers (the order of the agent-by-agent update; None: the
    chain's)."""
    updates = cfg.train.iterations * cfg.ppo.epochs * cfg.ppo.num_minibatches
    return UpdateConfig(ppo=cfg.ppo, optim=cfg.optim, algo=cfg.algo, rollout=cfg.rollout,
                        total_updates=max(updates, 1), remat=remat_policy(cfg),
                        layers=None if graph is None else graph.layers)


@dataclasses.dataclass
class Run:
    """Everything a command needs, built once."""

    config: Config
    model: registry.LoadedModel
    tokenizer: HFChatTokenizer
    task: Task
    team: Team
    pool: ScoringPool
    learner: TeamLearner

    def close(self) -> None:
        self.pool.close()


def build_run(cfg: Config) -> Run:
    """Load the model and build the task, team, scorer and learner for ``cfg``."""
    check_names(cfg)
    plan = distributed.initialize(cfg.dist)    # before anything that starts the XLA backend
    distributed.enable_compilation_cache(cfg.train.compilation_cache_dir)   # before the first compile
    team = build_team(cfg)
    task = build_task(cfg)
    dtype = model_dtype(cfg)
    weights_dtype = registry.default_dtype() if dtype is None else dtype   # what load_model loads in
    try:
        impl = attention_lib.resolve(cfg.model.attention, dtype=weights_dtype)
    except attention_lib.AttentionUnavailable as e:
        raise ConfigError(str(e)) from None
    try:
        decode_impl = cache_attention.resolve(cfg.model.decode_attention, dtype=weights_dtype)
        causal_impl = causal_attention.resolve(cfg.model.causal_attention, dtype=weights_dtype)
        matmul_impl = layer_matmul.resolve(cfg.model.decode_matmul, dtype=weights_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    placements: list[Placement] = []

    def place(model_cfg, abstract_params):
        """The mesh (checked against the model's config) and the base weights' shardings."""
        placements.append(Placement(distributed.build_mesh(cfg.mesh, model_cfg, rows=cfg.rollout.rows),
                                    strict=cfg.mesh.strict))
        return placements[-1].base_shardings(abstract_params)

    try:        # with several devices the base weights are born sharded (each process reads its blocks)
        model = registry.load_model(cfg.model.name, dtype=dtype, place=place if jax.device_count() > 1 else None,
                                    revision=cfg.model.revision)
    except sharding.ShardingRuleError as e:
        raise ConfigError(str(e)) from None
    # one device: a 1-device mesh (the weights load as they are: replicated there is the same array)
    placement = placements[-1] if placements else Placement(
        distributed.build_mesh(cfg.mesh, model.cfg, rows=cfg.rollout.rows), strict=cfg.mesh.strict)
    try:
        weights_impl = quant_matmul.resolve(cfg.model.decode_weights, quantized=model.quantized is not None,
                                            dtype=weights_dtype)
    except ValueError as e:
        raise ConfigError(f"{e} ({model.source})") from None
    model = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, attention=impl,
                                                               decode_attention=decode_impl,
                                                               causal_attention=causal_impl,
                                                               decode_matmul=matmul_impl,
                                                               decode_weights=weights_impl),
                                quantized=model.quantized if weights_impl == "native" else None)
    print(distributed.describe_devices(placement.mesh)
          + ("" if plan.initialize else f" ({plan.why})"), flush=True)
    tok = HFChatTokenizer(model.tokenizer, stop_ids=model.stop_token_ids)
    pool = ScoringPool(task, workers=cfg.train.scoring_workers)
    sampler = Sampler(model.cfg, pad_id=tok.pad_id, stop_ids=tok.stop_ids, max_prompt_len=cfg.rollout.context_window,
                      quantized=model.quantized)
    model = dataclasses.replace(model, quantized=None)   # the sampler holds the blocks: no second host copy
    sampler.place_on(placement)
    share = share_prefixes(cfg, model.cfg.attention)
    learner = TeamLearner(
        cfg=model.cfg, base=model.params, tokenizer=tok,
        sampler=sampler,
        team=team, score_fn=pool.score,
        rollout_cfg=cfg.rollout,
        update_cfg=update_config(cfg, team.topology),
        adv_cfg=AdvantageConfig(algo=cfg.algo, ppo=cfg.ppo, rollout=cfg.rollout,
                                independent=team.topology.independent, topology=team.topology,
                                layer_links=team.layer_links, share_prefixes=share),
        pack_sequences=cfg.ppo.pack_sequences,
        share_prefixes=share,
        placement=placement,
        rows=ProcessRows.of_this_process(),
    )
    return Run(config=cfg, model=model, tokenizer=tok, task=task, team=team, pool=pool, learner=learner)
