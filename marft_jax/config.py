"""Typed run configuration: dataclasses, YAML files and ``key=value`` overrides (OmegaConf).

Why OmegaConf: it merges YAML files and dotted command-line overrides into *structured*
configs built from our dataclasses, rejects unknown keys and wrong types with the dotted key in
the message, and is a small, long-maintained dependency (Hydra's core). Range checks that types
cannot express live in :func:`validate` and also name the dotted key.

Each concern has one dataclass, used directly by the code that runs it: ``Config.lora`` is the
:class:`LoraConfig` the adapters are built from, ``Config.optim`` the :class:`OptimConfig` of the
optimizers, ``Config.ppo`` the :class:`PPOConfig` the update reads, ``Config.algo`` the
:class:`AlgoConfig` of the rewards and backups, and ``Config.rollout`` the :class:`RolloutConfig`
the rollout and the sampler read (the training temperature lives there only). Those are frozen
(hashable: the update takes them as jit static arguments) and are validated once, here.

``load_config("demo", ["ppo.epochs=2"])`` takes a preset name from ``experiments/configs`` (or
the package copy of the demo), a YAML path, or nothing (the defaults), then the overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range (names the key)."""


@dataclass
class ModelSection:
    name: str = "smollm2-135m"          # registry name, HF directory, .gguf file or Hub id org/name
    revision: Optional[str] = None      # Hub branch, tag or commit of an org/name model; null = main
    dtype: str = "auto"                 # auto (float32 on CPU, bfloat16 on GPU/TPU) | float32 | bfloat16
    remat: Optional[str] = None         # none | full | keep_attention | dots | dots_no_batch (true/false = full/none); null = auto
    attention: str = "auto"             # auto | xla | cudnn | pallas | splash (marft_jax.models.attention)
    decode_attention: str = "auto"      # auto | xla | native: attention over the KV cache (marft_jax.models.cache_attention)
    causal_attention: str = "auto"      # auto | xla | native: whole-row attention under attention xla (marft_jax.models.causal_attention)
    decode_matmul: str = "auto"         # auto | xla | native: decode steps' projections (marft_jax.models.layer_matmul)
    decode_weights: str = "auto"        # auto | dequantized | native: decode steps read a GGUF file's blocks (marft_jax.models.quant_matmul)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (reference defaults: r 8, alpha 16, q_proj and v_proj); the adapter
    update is ``scale · (x A) B`` with ``scale = alpha / rank`` (PEFT's default)."""

    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # marft_jax.models.lora.TARGETS

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)


@dataclass
class TaskSection:
    name: str = "arithmetic"            # arithmetic | math | gsm8k | math500 | aime | humaneval | code_jsonl | generic
    path: Optional[str] = None          # local training file; null = the task's pinned Hub dataset (docs/tasks.md)
    eval_path: Optional[str] = None     # local evaluation file (default: the Hub test set, or a held-out split of path)
    level: int = 1                      # arithmetic difficulty
    train_size: int = 2000
    test_size: int = 200
    problem_field: Optional[str] = None
    answer_field: Optional[str] = None
    max_prompt_tokens: int = 1024       # over-long problems are filtered at load time
    code_reward: str = "fraction"       # fraction | binary
    hint_for_first_agent: bool = False  # heterogeneous observations: agent 0 sees the answer's parity


@dataclass
class TeamSection:
    profile: str = "math/duo"           # packaged profile name or a YAML/JSON file
    num_agents: int = 2
    answer_agent: Optional[int] = None  # default: the profile's answering agent
    # The team graph: chain | independent | mixture | debate; null = the profile's own
    # `parents` if it has them, else chain (rollout.mode=parallel: independent).
    graph: Optional[str] = None
    # How the agents of one layer are linked in the backup: chain (execution order, MARFT) |
    # layer (each links to the next layer's first agent). Chain and independent graphs ignore it.
    layer_links: str = "chain"


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are played (:func:`marft_jax.rl.rollout.rollout`) and sampled (its fields
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p`` are the sampler's settings)."""

    mode: str = "sequential"            # sequential (MARFT chain) | parallel (independent PPO)
    rows: int = 8                       # episodes per rollout
    # Episodes per problem: each problem is played by the team group_size times in consecutive
    # rows (rows / group_size problems per rollout); algo.advantage=group baselines each group.
    group_size: int = 1
    horizon: int = 1
    max_steps: Optional[int] = None
    max_new_tokens: int = 512           # per agent (the sampler's buffer size)
    agent_max_new_tokens: Optional[tuple[int, ...]] = None  # one budget per agent, each <= max_new_tokens
    context_window: int = 2048          # max context + response tokens; a budget shrinks to fit (counted)
    temperature: float = 1.0            # the training temperature: sampling, and every log-prob of PPO
    top_k: int = 0
    top_p: float = 1.0
    prompt_format: str = "chat"         # chat | g1_raw
    success_threshold: float = 1.0      # a step whose score reaches it ends the episode
    # A prompt that leaves less than the minimum generation budget (a quarter of the agent's) in
    # context_window: truncate_history (drop the oldest turns) | end_episode (truncated,
    # bootstrapped) | error (marft_jax.rl.rollout)
    overflow: str = "truncate_history"
    # Reuse the K/V of the prompt prefix an agent's step repeats from its previous step (the
    # history so far) instead of prefilling it again (marft_jax.sampling.prefix_reuse)
    reuse_prefix: bool = True

    def budget(self, agent: int) -> int:
        """Agent ``agent``'s token budget K_i."""
        k = self.agent_max_new_tokens
        return int(self.max_new_tokens if k is None else k[agent])

    @property
    def steps(self) -> int:
        """Steps played at most: the step cap, else the horizon."""
        return self.max_steps or self.horizon


@dataclass(frozen=True)
class AlgoConfig:
    """Decision level, rewards and backups."""

    level: str = "action"               # action (MARFT-A) | token (MARFT-T)
    # The advantage estimator (marft_jax.rl.advantages): gae (MARFT's backups from the critic) |
    # group (critic-free group baseline; rollout.group_size > 1) | any registered name.
    advantage: str = "gae"
    group_scale: str = "std"            # group: divide by the group's std (GRPO) | none (Dr. GRPO)
    gamma: Optional[float] = None       # default: 0.99 (action) / 1.0 (token)
    lam: Optional[float] = None         # default: 0.95 (action) / 1.0 (token)
    reward_to: str = "last"             # last | all
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: Optional[float] = None
    ippo_own_weight: float = 0.5        # independent PPO: w * own + (1 - w) * team mean
    reference_semantics: bool = False   # G1's backup masks and bootstrap (parity runs)

    @property
    def token_level(self) -> bool:
        return self.level == "token"

    @property
    def discount(self) -> float:
        """``gamma``, or the level's default."""
        return self.gamma if self.gamma is not None else (0.99 if self.level == "action" else 1.0)

    @property
    def gae_lambda(self) -> float:
        """``lam``, or the level's default."""
        return self.lam if self.lam is not None else (0.95 if self.level == "action" else 1.0)


@dataclass(frozen=True)
class PPOConfig:
    """PPO epochs, losses, clipping and the agent schedule (docs/algorithm.md#losses and
    docs/algorithm.md#the-update)."""

    epochs: int = 1
    num_minibatches: int = 1
    micro_batches: int = 1
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    value_loss: str = "huber"           # huber | mse
    huber_delta: float = 10.0
    ent_coef: float = 0.01
    vf_coef: float = 1.0
    adv_norm: str = "minibatch"         # minibatch | batch | none
    kl_stop: Optional[float] = 0.02
    max_grad_norm: float = 0.5
    critic_max_grad_norm: float = 0.5
    logprob_norm: str = "sum"           # sum | token | word
    agent_schedule: str = "sequential"  # sequential | concurrent | interval
    # Agents of one team-graph layer under `sequential`: in_order (one after another, the factor
    # carried on) | concurrent (vmap from the layer's incoming HAPPO factor).
    layer_update: str = "in_order"
    happo_weighting: bool = True
    happo_clip: Optional[float] = 0.2
    interval: int = 1000                # env samples per agent under `interval`
    interval_offset: int = 0
    critic_warmup: int = 0              # iterations that train only the critic
    critic_lora: bool = False
    logp_old: str = "sampler"           # sampler (the rollout's own log-probs) | recompute (a training forward)
    pack_sequences: bool = True         # packed sequences in the feature pass and the update (False: padded)
    share_prefixes: bool = True         # packed rows compute a step's prefix repeated from the step before once


@dataclass(frozen=True)
class OptimConfig:
    """Policy AdamW / critic Adam settings (docs/algorithm.md#gradient-clipping-and-optimizers);
    the cosine schedule runs over the run's update count, which
    :func:`marft_jax.rl.state.policy_optimizer` takes."""

    policy_lr: float = 1e-6
    critic_lr: float = 5e-5
    eps: float = 1e-5
    weight_decay: float = 0.0
    schedule: str = "constant"          # constant | cosine
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.05


@dataclass
class ProfileSection:
    start: Optional[int] = None         # first iteration (0-based) traced with jax.profiler; null = off
    steps: int = 1                      # iterations traced
    dir: Optional[str] = None           # default <run dir>/profile


@dataclass
class WandbSection:
    # Used when train.loggers names wandb (pip install 'marft-jax[wandb]').
    project: str = "marft-jax"
    name: Optional[str] = None          # W&B run name; default the run folder's name
    dir: Optional[str] = None           # W&B writes <dir>/wandb/; default the run folder
    mode: Optional[str] = None          # offline | online | disabled; null = $WANDB_MODE, else offline


@dataclass
class TrainSection:
    iterations: int = 100
    seed: int = 0
    out_dir: str = "runs"
    run_name: Optional[str] = None
    eval_every: int = 0                 # 0: only before and after training
    eval_problems: int = 64
    eval_batch_size: int = 64           # episodes per evaluation sampler call (larger = faster on CPU)
    eval_before: bool = True            # false: skip the untrained evaluation (sweeps that share one)
    eval_temperature: float = 0.0       # the demo evaluates greedily; `marft-jax eval` uses 0.6
    save_every: int = 10                # 0: only the final checkpoint
    keep_last: int = 3
    time_budget_s: Optional[float] = None
    scoring_workers: int = 2
    log_every: int = 1
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])  # jsonl (required) | tensorboard | wandb
    wandb: WandbSection = field(default_factory=WandbSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    # JAX's persistent compilation cache: auto (GPU/TPU: ~/.cache/marft_jax/xla, CPU: off), a
    # directory, or off / "" (distributed.compilation_cache_dir).
    compilation_cache_dir: str = "auto"


@dataclass
class MeshSection:
    # A (data, fsdp, tensor) device mesh over all processes' devices; -1 = the devices the other
    # axes leave (at most one axis). docs/many_devices.md has the placement table.
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    strict: bool = False                # a sharding rule that cannot apply raises (default: warns once)


@dataclass
class DistSection:
    # jax.distributed start-up. auto: initialise where JAX detects a cluster (SLURM, TPU pod,
    # Kubernetes, Open MPI) or where coordinator / JAX_COORDINATOR_ADDRESS is set; off: one process.
    initialize: str = "auto"
    coordinator: Optional[str] = None   # host:port of process 0 (env JAX_COORDINATOR_ADDRESS)
    num_processes: Optional[int] = None  # env JAX_NUM_PROCESSES
    process_id: Optional[int] = None    # env JAX_PROCESS_ID
    timeout_s: int = 300                # how long processes wait for each other at start-up
    heartbeat_timeout_s: int = 100      # a process silent this long is dead: the others exit with an error


@dataclass
class Config:
    preset: str = "default"
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraConfig = field(default_factory=LoraConfig)
    task: TaskSection = field(default_factory=TaskSection)
    team: TeamSection = field(default_factory=TeamSection)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    dist: DistSection = field(default_factory=DistSection)

    @property
    def gamma(self) -> float:
        return self.algo.discount

    @property
    def lam(self) -> float:
        return self.algo.gae_lambda


PRESET_DIR = Path(__file__).resolve().parents[1] / "experiments" / "configs"
PACKAGED_PRESETS = Path(__file__).resolve().parent / "presets"

_CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16"),
    "model.attention": ("auto", "xla", "cudnn", "pallas", "splash"),
    "model.decode_attention": ("auto", "xla", "native"),
    "model.causal_attention": ("auto", "xla", "native"),
    "model.decode_matmul": ("auto", "xla", "native"),
    "model.decode_weights": ("auto", "dequantized", "native"),
    "task.name": ("arithmetic", "math", "gsm8k", "math500", "aime", "humaneval", "code_jsonl", "generic"),
    "task.code_reward": ("fraction", "binary"),
    "rollout.mode": ("sequential", "parallel"),
    "rollout.prompt_format": ("chat", "g1_raw"),
    "rollout.overflow": ("truncate_history", "end_episode", "error"),
    "algo.level": ("action", "token"),
    "algo.reward_to": ("last", "all"),
    "algo.group_scale": ("std", "none"),
    "ppo.value_loss": ("huber", "mse"),
    "ppo.adv_norm": ("minibatch", "batch", "none"),
    "ppo.logprob_norm": ("sum", "token", "word"),
    "ppo.logp_old": ("sampler", "recompute"),
    "ppo.agent_schedule": ("sequential", "concurrent", "interval"),
    "ppo.layer_update": ("in_order", "concurrent"),
    "optim.schedule": ("constant", "cosine"),
    "dist.initialize": ("auto", "on", "off"),
}


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _need(cfg: Config):
    """``need(key, ok, what)``: raises :class:`ConfigError` naming ``key``, its value and ``what`` it must be."""

    def need(key: str, ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: must be {what}")
    return need


def _check_model_team_rollout(cfg: Config, need) -> None:
    """``model.remat``, ``team.num_agents`` and the ``rollout`` section."""
    if cfg.model.remat is not None:
        need("model.remat", str(cfg.model.remat).lower() in ("true", "false", "auto", "none", "full", "keep_attention",
                                                           "dots", "dots_no_batch"),
             "one of none, full, keep_attention, dots, dots_no_batch (true = full, false = none) or null (auto)")
    need("team.num_agents", cfg.team.num_agents >= 1, ">= 1")
    need("rollout.rows", cfg.rollout.rows >= 1, ">= 1")
    need("rollout.horizon", cfg.rollout.horizon >= 1, ">= 1")
    need("rollout.max_new_tokens", cfg.rollout.max_new_tokens >= 1, ">= 1")
    need("rollout.context_window", cfg.rollout.context_window > cfg.rollout.max_new_tokens,
         f"> rollout.max_new_tokens ({cfg.rollout.max_new_tokens})")
    budgets = cfg.rollout.agent_max_new_tokens
    if budgets is not None:
        need("rollout.agent_max_new_tokens", len(budgets) == cfg.team.num_agents,
             f"one budget per agent (team.num_agents={cfg.team.num_agents})")
        need("rollout.agent_max_new_tokens", all(1 <= k <= cfg.rollout.max_new_tokens for k in budgets),
             f"budgets in [1, rollout.max_new_tokens={cfg.rollout.max_new_tokens}]")
    need("rollout.temperature", cfg.rollout.temperature > 0, "> 0 for training rollouts")
    need("rollout.top_k", cfg.rollout.top_k >= 0, ">= 0 (0 = off)")
    need("rollout.top_p", 0 < cfg.rollout.top_p <= 1, "in (0, 1]")
    if cfg.rollout.max_steps is not None:
        need("rollout.max_steps", 1 <= cfg.rollout.max_steps <= cfg.rollout.horizon, "in [1, rollout.horizon]")
    need("rollout.group_size", cfg.rollout.group_size >= 1, ">= 1")
    need("rollout.group_size", cfg.rollout.rows % cfg.rollout.group_size == 0,
         f"a divisor of rollout.rows ({cfg.rollout.rows}): a rollout plays rows / group_size problems")


def _check_lora_optim_ppo(cfg: Config, need) -> None:
    """The ``lora``, ``optim`` and ``ppo`` sections."""
    need("lora.rank", cfg.lora.rank >= 1, ">= 1")
    need("lora.alpha", cfg.lora.alpha > 0, "> 0")
    for key in ("optim.policy_lr", "optim.critic_lr", "optim.eps"):
        need(key, _get(cfg, key) > 0, "> 0")
    need("optim.weight_decay", cfg.optim.weight_decay >= 0, ">= 0")
    need("optim.warmup_ratio", 0 <= cfg.optim.warmup_ratio < 1, "in [0, 1)")
    for key in ("ppo.clip_eps", "ppo.value_clip_eps"):
        need(key, _get(cfg, key) > 0, "> 0")
    need("ppo.layer_update", cfg.ppo.layer_update == "in_order" or cfg.ppo.agent_schedule == "sequential",
         f"in_order with ppo.agent_schedule={cfg.ppo.agent_schedule!r} (layers update concurrently only "
         "within the sequential scan)")
    if cfg.ppo.happo_clip is not None:
        need("ppo.happo_clip", cfg.ppo.happo_clip > 0, "> 0 or null")
    if cfg.ppo.kl_stop is not None:
        need("ppo.kl_stop", cfg.ppo.kl_stop > 0, "> 0 or null")
    for key in ("ppo.max_grad_norm", "ppo.critic_max_grad_norm", "ppo.huber_delta"):
        need(key, _get(cfg, key) > 0, "> 0")
    for key in ("ppo.ent_coef", "ppo.vf_coef", "ppo.critic_warmup"):
        need(key, _get(cfg, key) >= 0, ">= 0")
    for key in ("ppo.epochs", "ppo.num_minibatches", "ppo.micro_batches", "ppo.interval", "train.keep_last"):
        need(key, _get(cfg, key) >= 1, ">= 1")
    need("ppo.num_minibatches", cfg.rollout.rows % cfg.ppo.num_minibatches == 0,
         f"a divisor of rollout.rows ({cfg.rollout.rows})")
    need("ppo.micro_batches", (cfg.rollout.rows // cfg.ppo.num_minibatches) % cfg.ppo.micro_batches == 0,
         f"a divisor of the minibatch rows (rollout.rows / ppo.num_minibatches = "
         f"{cfg.rollout.rows // cfg.ppo.num_minibatches})")


def _check_algo_train(cfg: Config, need) -> None:
    """The ``algo`` and ``train`` sections."""
    need("algo.reward_scale", cfg.algo.reward_scale > 0, "> 0")
    if cfg.algo.reward_clip is not None:
        need("algo.reward_clip", cfg.algo.reward_clip > 0, "> 0 or null")
    need("algo.ippo_own_weight", 0 <= cfg.algo.ippo_own_weight <= 1, "in [0, 1]")
    for key in ("algo.gamma", "algo.lam"):
        v = _get(cfg, key)
        if v is not None:
            need(key, 0 <= v <= 1, "in [0, 1]")
    need("train.iterations", cfg.train.iterations >= 0, ">= 0")
    if cfg.train.profile.start is not None:
        need("train.profile.start", cfg.train.profile.start >= 0, ">= 0 or null (off)")
    need("train.profile.steps", cfg.train.profile.steps >= 1, ">= 1")
    cache = cfg.train.compilation_cache_dir
    need("train.compilation_cache_dir", isinstance(cache, str) and not (
        cache.strip().lower() not in ("auto", "off", "", "false", "none") and Path(cache).expanduser().is_file()),
         "auto, off, \"\" (off) or a directory (not a file)")
    need("train.eval_problems", cfg.train.eval_problems >= 1, ">= 1")
    need("train.eval_batch_size", cfg.train.eval_batch_size >= 1, ">= 1")
    need("train.eval_temperature", cfg.train.eval_temperature >= 0, ">= 0")
    need("train.scoring_workers", cfg.train.scoring_workers >= 0, ">= 0")
    need("train.log_every", cfg.train.log_every >= 1, ">= 1")
    need("train.eval_every", cfg.train.eval_every >= 0, ">= 0 (0: evaluate before and after training only)")
    need("train.save_every", cfg.train.save_every >= 0, ">= 0 (0: only the final checkpoint)")
    if cfg.train.time_budget_s is not None:
        need("train.time_budget_s", cfg.train.time_budget_s >= 0, ">= 0 or null (0 or null: no budget)")


def _check_task_mesh_dist(cfg: Config, need) -> None:
    """``team.answer_agent`` and the ``task``, ``mesh`` and ``dist`` sections."""
    if cfg.team.answer_agent is not None:
        need("team.answer_agent", 0 <= cfg.team.answer_agent < cfg.team.num_agents,
             f"in [0, team.num_agents={cfg.team.num_agents})")
    need("task.level", 1 <= cfg.task.level <= 5, "in [1, 5]")
    for key in ("mesh.data", "mesh.fsdp", "mesh.tensor"):
        need(key, _get(cfg, key) == -1 or _get(cfg, key) >= 1, ">= 1, or -1 (the devices the other axes leave)")
    rest = [k for k in ("mesh.data", "mesh.fsdp", "mesh.tensor") if _get(cfg, k) == -1]
    if len(rest) > 1:
        raise ConfigError(f"{' and '.join(rest)} are both -1: at most one mesh axis takes the remaining devices")
    if cfg.dist.num_processes is not None:
        need("dist.num_processes", cfg.dist.num_processes >= 1, ">= 1 or null")
    if cfg.dist.process_id is not None:
        need("dist.process_id", cfg.dist.process_id >= 0, ">= 0 or null")
        if cfg.dist.num_processes is not None:
            need("dist.process_id", cfg.dist.process_id < cfg.dist.num_processes,
                 f"< dist.num_processes ({cfg.dist.num_processes})")
    need("dist.timeout_s", cfg.dist.timeout_s >= 1, ">= 1")
    need("dist.heartbeat_timeout_s", cfg.dist.heartbeat_timeout_s >= 1, ">= 1")


def validate(cfg: Config) -> Config:
    """Range and choice checks; raises :class:`ConfigError` naming the dotted key. Keys whose
    values are a registry's names (``lora.targets``, ``team.graph``, ``team.layer_links``,
    ``train.loggers``, ``train.wandb.mode``, ``algo.advantage``) are checked beside their registries, at build
    (``marft_jax.train.build.check_names``): this module imports nothing of the package."""
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not one of {list(choices)}")

    need = _need(cfg)
    for check in (_check_model_team_rollout, _check_lora_optim_ppo, _check_algo_train, _check_task_mesh_dist):
        check(cfg, need)
    return cfg


def resolve_preset(name: str) -> Path:
    """A preset name (``demo``, ``paper/math-duo-marft-a-qwen2.5-3b``) or a YAML path."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        return p
    for root in (PRESET_DIR, PACKAGED_PRESETS):
        cand = root / f"{name}.yaml"
        if cand.is_file():
            return cand
    known = sorted({str(q.relative_to(r))[:-5] for r in (PRESET_DIR, PACKAGED_PRESETS) if r.is_dir()
                    for q in r.rglob("*.yaml")})
    raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(known) or 'none'}")


def load_config(preset: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- preset YAML <- ``key=value`` overrides, typed and validated."""
    schema = OmegaConf.structured(Config)
    try:
        layers = [schema]
        if preset:
            path = resolve_preset(preset)
            try:
                layers.append(OmegaConf.load(path))
            except Exception as e:  # YAML syntax errors
                raise ConfigError(f"{path}: cannot parse YAML ({e})") from e
            try:
                OmegaConf.merge(schema, layers[-1])
            except OmegaConfBaseException as e:
                key = getattr(e, "full_key", None)
                raise ConfigError(f"{path}: config key {key!r}: {str(e).splitlines()[0]}") from e
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"override {o!r} must look like key=value (e.g. ppo.epochs=2)")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {msg}" if key else f"config: {msg}") from e
    return validate(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
