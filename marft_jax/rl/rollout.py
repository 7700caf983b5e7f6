"""Multi-agent rollout over the team graph (:mod:`marft_jax.rl.topology`).

Within a step the graph's layers act in order; the agents of one layer generate for every
active row in one batched sampler call (per-row adapter ids), and an agent's context holds the
current-step outputs of its parents only (docs/algorithm.md#rollout-and-contexts). The chain
(MARFT) is N layers of one agent: agent ``i`` sees agents ``0 … i-1``. Independent PPO
(``parallel`` mode, docs/algorithm.md#independent-learners) is one layer of N: every agent sees
only the task and earlier steps. The answering agents' outputs are scored; with several
answerers the team's score is their mean.
Multi-step episodes append the environment's feedback and continue until the answer is
accepted (``score ≥ success_threshold``), the horizon is reached (terminal), or the step cap
``max_steps`` cuts them (truncated, bootstrapped from the next-step context of the graph's
bootstrap agent: ``Topology.bootstrap_agents``, every agent for independent learners).

Context overflow (``rollout.overflow``). Every sampled prompt must leave at least the minimum
generation budget (:func:`min_budget`: a quarter of the agent's budget, rounded up) in
``rollout.context_window``; between that and the full budget the budget shrinks to fit (the
response is then counted as clipped). A prompt that does not fit:

* ``truncate_history`` (default): the oldest turns are dropped until it fits: earlier steps'
  records (the team's outputs and the feedback), oldest first, then the current step's parent
  outputs, oldest first; the system prompt and the task always stay. If they alone do not fit,
  the run stops with an error naming ``rollout.context_window`` and the row.
* ``end_episode``: a row one of whose step-``s`` prompts does not fit (``s ≥ 1``) ends after
  step ``s - 1`` as truncated (bootstrapped from the critic's value, not a terminal 0); what its
  agents had sampled at step ``s`` is discarded. At step 0 there is nothing to end, so the
  prompt is truncated as above.
* ``error``: the run stops with an error naming the key, the row and the lengths.

The bootstrap contexts and the critic's joint-history contexts are fitted like the prompts under
the first two policies (left as built under ``error``). The trajectory stores each prompt
exactly as the sampler got it, so the training passes see the tokens the sampler saw.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from marft_jax.config import RolloutConfig
from marft_jax.envs.chat import ChatTokenizer, StepRecord, build_messages, g1_raw_prompt
from marft_jax.envs.task import Problem, Score, Transcript
from marft_jax.rl import topology as topo
from marft_jax.rl.trajectory import Trajectory
from marft_jax.sampling.buckets import length_bucket


class Generation(NamedTuple):
    """Sampler output for ``n`` prompts: tokens ``[n, K]``, lengths ``[n]``, logp ``[n, K]``
    (at the sampling temperature); optionally the policy's own log-probs and entropies
    ``[n, K]`` (full vocabulary at the training temperature), which become PPO's old log-probs."""

    tokens: np.ndarray
    lengths: np.ndarray
    logp: np.ndarray
    policy_logp: np.ndarray | None = None
    entropy: np.ndarray | None = None


# The environment's message after an unsuccessful step.
FEEDBACK = "The answer is incorrect."

# (prompts, agent ids [n], max_new_tokens, key) -> Generation
GenerateFn = Callable[[Sequence[Sequence[int]], np.ndarray, int, jax.Array], Generation]
# transcripts -> scores (in order); the trainer passes a pooled scorer
ScoreFn = Callable[[Sequence[Transcript]], Sequence[Score]]


class RowGroup(Protocol):
    """The processes that play one batch together, each its own rows
    (:class:`marft_jax.train.hosts.ProcessRows`); every process calls these together."""

    def any(self, flag: bool) -> bool: ...

    def max(self, value: int) -> int: ...


@dataclasses.dataclass
class RolloutTexts:
    """Host-side texts: ``outputs[s][b][i]`` decoded response ('' when not played);
    ``infos[s][b]``: the scorer's info dict of the step; ``sampler_calls``: sampler calls per
    played env step (the graph's layer count); ``overflow_truncated``: sampled prompts whose
    oldest turns were dropped, ``overflow_ended``: episodes ended because a prompt did not fit
    (``rollout.overflow``)."""

    outputs: list[list[list[str]]]
    infos: list[list[dict]]
    sampler_calls: float = 0.0
    overflow_truncated: int = 0
    overflow_ended: int = 0


@dataclasses.dataclass(frozen=True)
class Team:
    """Profiles of the team: role names, system prompts, answering agent, the team graph
    (None: the chain, or independent agents in ``parallel`` mode) and how the agents of one
    layer are linked (``team.layer_links``: ``chain`` gives non-chain graphs a joint-history
    critic context, ``layer`` keeps each agent's own context for the critic)."""

    roles: tuple[str, ...]
    system_prompts: tuple[str, ...]
    answer_agent: int
    topology: topo.Topology | None = None
    layer_links: str = "chain"

    def __post_init__(self) -> None:
        if self.layer_links not in topo.LAYER_LINKS:
            raise ValueError(f"team.layer_links must be one of {topo.LAYER_LINKS}, got {self.layer_links!r}")

    @property
    def num_agents(self) -> int:
        return len(self.roles)

    def graph(self, mode: str) -> topo.Topology:
        if self.topology is not None:
            return self.topology
        return topo.resolve(None, roles=self.roles, answer_agent=self.answer_agent, mode=mode)


def min_budget(cfg: RolloutConfig, agent: int) -> int:
    """The fewest new tokens a prompt of agent ``agent`` must leave in ``rollout.context_window``:
    a quarter of its budget, rounded up (``rollout.overflow`` acts on a prompt that leaves fewer)."""
    return max(1, -(-cfg.budget(agent) // 4))


def _context(team: Team, problem: Problem, agent: int, history, current: dict[int, str],
             cfg: RolloutConfig, tok, drop: int = 0):
    """Agent ``agent``'s context; ``current`` maps the parents it reads to their outputs.
    ``drop``: the oldest turns left out, earlier steps' records first, then current parents."""
    parents = list(current.items())[max(0, drop - len(history)):]
    history = history[drop:]
    roles = [team.roles[j] for j, _ in parents]
    outs = [o for _, o in parents]
    if cfg.prompt_format == "g1_raw":
        return tok.encode_text(g1_raw_prompt(team.system_prompts[agent], problem.view(agent), team.roles,
                                             history, outs, agent, current_roles=roles))
    return tok.encode_chat(build_messages(team.system_prompts[agent], problem.view(agent), team.roles,
                                          history, outs, current_roles=roles))


def _where(team: Team, problem: Problem, row: int, agent: int, step: int) -> str:
    return f"row {row} (problem {problem.uid!r}), agent {agent} ({team.roles[agent]}), step {step}"


def _fitted(team: Team, problem: Problem, agent: int, history, current: dict[int, str], cfg: RolloutConfig,
            tok, *, row: int, step: int) -> tuple[list[int], int]:
    """Agent ``agent``'s context with the fewest oldest turns dropped that leaves
    :func:`min_budget` in the window. Returns (tokens, turns dropped)."""
    room = cfg.context_window - min_budget(cfg, agent)
    for drop in range(len(history) + len(current) + 1):
        prompt = _context(team, problem, agent, history, current, cfg, tok, drop)
        if len(prompt) <= room:
            return prompt, drop
    raise ValueError(
        f"rollout.context_window={cfg.context_window}: {_where(team, problem, row, agent, step)}: the system "
        f"prompt and the task alone take {len(prompt)} tokens, leaving fewer than the minimum generation budget "
        f"of {min_budget(cfg, agent)} tokens; raise rollout.context_window or shorten the task "
        f"(task.max_prompt_tokens)")


def _overflow_error(team: Team, problem: Problem, prompt: list[int], cfg: RolloutConfig, *, row: int,
                    agent: int, step: int) -> ValueError:
    return ValueError(
        f"rollout.overflow=error: {_where(team, problem, row, agent, step)}: the prompt has {len(prompt)} "
        f"tokens; with the minimum generation budget of {min_budget(cfg, agent)} tokens it exceeds "
        f"rollout.context_window={cfg.context_window} (rollout.overflow=truncate_history drops the oldest "
        f"turns instead)")


def rollout(
    problems: Sequence[Problem],
    *,
    team: Team,
    tokenizer: ChatTokenizer,
    generate: GenerateFn,
    score: ScoreFn,
    cfg: RolloutConfig,
    key: jax.Array,
    min_context_bucket: int = 16,
    feedback: str = FEEDBACK,
    group: RowGroup | None = None,
) -> tuple[Trajectory, RolloutTexts]:
    """Play one batch of episodes and return the trajectory (numpy arrays) and the texts.

    ``min_context_bucket``: the smallest context bucket (power-of-two buckets above it);
    ``feedback``: the environment's message after an unsuccessful step.

    ``group``: with several processes, ``problems`` are this process's rows and ``generate``
    runs every process's prompts together (``marft_jax.train.iteration.make_generate``); the
    step loop runs while any process has a live row (a process without one makes its sampler
    calls with no prompts) and the context bucket is the largest over the processes, so every
    process makes the same calls and returns arrays of the same ``S, N, L, K``. None: one
    process."""
    graph = team.graph(cfg.mode)
    if graph.num_agents != team.num_agents:
        raise ValueError(f"the team graph has {graph.num_agents} agents, the team {team.num_agents}")
    anyone = (lambda flag: flag) if group is None else group.any
    got = _play(problems, team, graph, tokenizer, generate, score, cfg, key, feedback, anyone)
    traj = _build_trajectory(got, pad_id=tokenizer.pad_id, min_context_bucket=min_context_bucket, group=group)
    return traj, RolloutTexts(outputs=got.outputs, infos=got.infos,
                              sampler_calls=got.calls_made / max(got.steps_played, 1),
                              overflow_truncated=got.overflow_truncated, overflow_ended=got.overflow_ended)


@dataclasses.dataclass
class _Collected:
    """What the step loop collected for ``B`` rows, ``N`` agents, ``S`` steps and the sampler's
    buffer ``K`` (the largest budget); host numpy, filled in place by :func:`_play` and read by
    :func:`_build_trajectory`.

    Contexts (token lists, unpadded): ``ctx[(s, b, i)]`` the prompt agent ``i`` was sampled with;
    ``boot[(b, i)]`` a truncated row's bootstrap context; ``critic_ctx[(s, b, i)]`` the
    joint-history critic context (None: every critic reads its own agent's prompt).
    Arrays: ``act`` int32, ``logp``, ``policy_logp``, ``entropy`` float32 ``[S, B, N, K]``
    (the last two kept while ``has_policy_logp``); ``act_len``, ``words`` int32 and ``clipped``
    bool ``[S, B, N]``; ``step_mask``, ``terminal``, ``truncated`` bool ``[S, B]``; ``score``
    ``[S, B]`` and ``agent_score`` ``[S, B, N]`` float32. Texts ``outputs[s][b][i]``,
    ``infos[s][b]`` (:class:`RolloutTexts`). Counters: sampler calls, steps played, prompts whose
    oldest turns were dropped and episodes ended (``rollout.overflow``)."""

    ctx: dict[tuple[int, int, int], list[int]]
    boot: dict[tuple[int, int], list[int]]
    critic_ctx: dict[tuple[int, int, int], list[int]] | None
    act: np.ndarray
    act_len: np.ndarray
    logp: np.ndarray
    policy_logp: np.ndarray
    entropy: np.ndarray
    words: np.ndarray
    clipped: np.ndarray
    step_mask: np.ndarray
    terminal: np.ndarray
    truncated: np.ndarray
    score: np.ndarray
    agent_score: np.ndarray
    outputs: list[list[list[str]]]
    infos: list[list[dict]]
    has_policy_logp: bool = True
    calls_made: int = 0
    steps_played: int = 0
    overflow_truncated: int = 0
    overflow_ended: int = 0

    @classmethod
    def empty(cls, S: int, B: int, N: int, K: int, *, joint_critic: bool) -> _Collected:
        """Nothing played yet; ``joint_critic``: some critic reads the joint history."""
        def zeros(*shape: int, dtype=np.float32) -> np.ndarray:
            return np.zeros(shape, dtype)
        return cls(ctx={}, boot={}, critic_ctx={} if joint_critic else None,
                   act=zeros(S, B, N, K, dtype=np.int32), act_len=zeros(S, B, N, dtype=np.int32),
                   logp=zeros(S, B, N, K), policy_logp=zeros(S, B, N, K), entropy=zeros(S, B, N, K),
                   words=zeros(S, B, N, dtype=np.int32), clipped=zeros(S, B, N, dtype=bool),
                   step_mask=zeros(S, B, dtype=bool), terminal=zeros(S, B, dtype=bool),
                   truncated=zeros(S, B, dtype=bool), score=zeros(S, B), agent_score=zeros(S, B, N),
                   outputs=[[["" for _ in range(N)] for _ in range(B)] for _ in range(S)],
                   infos=[[{} for _ in range(B)] for _ in range(S)])

    def store(self, s: int, calls: list[tuple[int, int, list[int]]], gen: Generation, cfg: RolloutConfig,
              tokenizer: ChatTokenizer) -> None:
        """Store one sampler call's output at step ``s``; ``calls`` are its (row, agent, prompt)
        triples in call order. A response is cut to its agent's budget and to the window."""
        self.has_policy_logp = self.has_policy_logp and gen.policy_logp is not None and gen.entropy is not None
        for j, (b, a, prompt) in enumerate(calls):
            self.ctx[(s, b, a)] = prompt
            limit = min(cfg.budget(a), max(cfg.context_window - len(prompt), 1))
            n = int(min(gen.lengths[j], limit))
            self.act[s, b, a, :n] = gen.tokens[j, :n]
            self.logp[s, b, a, :n] = gen.logp[j, :n]
            if self.has_policy_logp:
                self.policy_logp[s, b, a, :n] = gen.policy_logp[j, :n]
                self.entropy[s, b, a, :n] = gen.entropy[j, :n]
            self.act_len[s, b, a] = n
            self.clipped[s, b, a] = n >= limit and (n == 0 or int(gen.tokens[j, n - 1]) not in tokenizer.stop_ids)
            text = tokenizer.decode(gen.tokens[j, :n]).rstrip()
            self.outputs[s][b][a] = text
            self.words[s, b, a] = len(text.split())

    def discard(self, s: int, b: int) -> None:
        """Forget what row ``b``'s agents sampled at step ``s`` (the episode ended before it)."""
        for a in range(self.act.shape[2]):
            self.ctx.pop((s, b, a), None)
            self.outputs[s][b][a] = ""
        for x in (self.act, self.act_len, self.logp, self.policy_logp, self.entropy, self.words, self.clipped):
            x[s, b] = 0


@dataclasses.dataclass(frozen=True)
class _Contexts:
    """Builds the agents' contexts of one batch under ``rollout.overflow``: per row ``b`` its
    problem and its history (the finished steps' records, appended by the step loop)."""

    team: Team
    problems: Sequence[Problem]
    history: list[list[StepRecord]]
    cfg: RolloutConfig
    tokenizer: ChatTokenizer

    def prompt(self, b: int, i: int, s: int, current: dict[int, str]) -> tuple[list[int] | None, bool]:
        """Agent ``i``'s prompt at step ``s`` of row ``b`` (``current``: the agents it reads -> their
        step-``s`` outputs) and whether oldest turns were dropped; None: it does not fit and the
        episode ends (``end_episode``)."""
        cfg, team, problem, tok = self.cfg, self.team, self.problems[b], self.tokenizer
        if cfg.overflow == "error" or (cfg.overflow == "end_episode" and s > 0):
            p = _context(team, problem, i, self.history[b], current, cfg, tok)
            if len(p) + min_budget(cfg, i) <= cfg.context_window:
                return p, False
            if cfg.overflow == "error":
                raise _overflow_error(team, problem, p, cfg, row=b, agent=i, step=s)
            return None, False
        p, dropped = _fitted(team, problem, i, self.history[b], current, cfg, tok, row=b, step=s)
        return p, dropped > 0

    def state(self, b: int, i: int, s: int, current: dict[int, str]) -> list[int]:
        """A context that is not sampled (the bootstrap state, the critic's joint history):
        fitted as a prompt would be, except under ``error``, which leaves it as built."""
        cfg, team, problem, tok = self.cfg, self.team, self.problems[b], self.tokenizer
        if cfg.overflow == "error":
            return _context(team, problem, i, self.history[b], current, cfg, tok)
        return _fitted(team, problem, i, self.history[b], current, cfg, tok, row=b, step=s)[0]


def _play(problems: Sequence[Problem], team: Team, graph: topo.Topology, tokenizer: ChatTokenizer,
          generate: GenerateFn, score: ScoreFn, cfg: RolloutConfig, key: jax.Array, feedback: str,
          anyone: Callable[[bool], bool]) -> _Collected:
    """The step loop over ``S = cfg.steps`` steps of ``B = len(problems)`` rows: sample the graph's
    layers, end rows whose prompts do not fit (``end_episode``), build the joint-history critic
    contexts, score, then append each live row's step record and bootstrap the truncated ones.
    Each played step splits ``key`` into the next key and one key per agent (``N + 1``).
    ``anyone``: whether any process has the flag set (the loop runs while any has a live row)."""
    B, N, S = len(problems), team.num_agents, cfg.steps
    joint = graph.joint_critic_agents(team.layer_links)
    got = _Collected.empty(S, B, N, max(cfg.budget(i) for i in range(N)), joint_critic=bool(joint))
    contexts = _Contexts(team, problems, [[] for _ in range(B)], cfg, tokenizer)
    active = np.ones(B, bool)
    for s in range(S):
        rows = np.flatnonzero(active)
        if not anyone(rows.size > 0):
            break
        got.steps_played += 1
        key, *agent_keys = jax.random.split(key, N + 1)
        ended = _sample_step(got, contexts, graph, generate, s, rows, agent_keys, anyone)
        for b in ended:              # truncated after step s - 1, bootstrapped from the step-s state
            got.discard(s, b)
            got.truncated[s - 1, b] = True
            for i in graph.bootstrap_agents:
                got.boot[(b, i)] = contexts.state(b, i, s, {})
        got.overflow_ended += len(ended)
        active[ended] = False
        rows = np.array([b for b in rows if b not in ended], np.int64)
        got.step_mask[s, rows] = True
        for b in rows:
            for i in joint:
                got.critic_ctx[(s, b, i)] = contexts.state(
                    b, i, s, {j: got.outputs[s][b][j] for j in graph.joint_reads(i)})
        term, trunc = _score_step(got, s, rows, problems, team, graph, score, cfg)
        for j, b in enumerate(rows):
            contexts.history[b].append(StepRecord(tuple(got.outputs[s][b]), None if term[j] else feedback))
            if trunc[j]:
                for i in graph.bootstrap_agents:
                    got.boot[(b, i)] = contexts.state(b, i, s + 1, {})
        active[rows[term | trunc]] = False
    return got


def _sample_step(got: _Collected, contexts: _Contexts, graph: topo.Topology, generate: GenerateFn, s: int,
                 rows: np.ndarray, agent_keys: list[jax.Array], anyone: Callable[[bool], bool]) -> list[int]:
    """Sample step ``s`` for the live ``rows`` ``[n]``: one sampler call per layer, with its first
    agent's key, each agent's prompt holding its parents' step-``s`` outputs. Returns the rows one
    of whose prompts does not fit (``end_episode``: no later layer samples them), in order."""
    cfg = contexts.cfg
    ended: list[int] = []
    for layer in graph.layers:
        calls: list[tuple[int, int, list[int]]] = []
        for b in rows:
            if b in ended:
                continue
            mine = []
            for i in layer:
                prompt, dropped = contexts.prompt(b, i, s, {j: got.outputs[s][b][j] for j in graph.parents[i]})
                got.overflow_truncated += dropped
                mine.append((b, i, prompt))
            if any(p is None for _, _, p in mine):
                ended.append(b)
            else:
                calls += mine
        # end_episode can leave a layer without prompts: skip its call if every process has none
        if cfg.overflow != "end_episode" or anyone(bool(calls)):
            _sample(got, calls, s, agent_keys[layer[0]], generate, cfg, contexts.tokenizer)
    return ended


def _sample(got: _Collected, calls: list[tuple[int, int, list[int]]], s: int, key: jax.Array,
            generate: GenerateFn, cfg: RolloutConfig, tokenizer: ChatTokenizer) -> None:
    """One sampler call for the (row, agent, prompt) triples of step ``s`` (none: this process
    has no live row), at the largest of their agents' budgets; stores the output."""
    agents = np.array([a for _, a, _ in calls], np.int32)
    budget = max((cfg.budget(a) for a in agents), default=0)
    got.calls_made += 1
    with jax.profiler.TraceAnnotation(f"rollout/step{s}/agents{'+'.join(map(str, sorted(set(agents.tolist()))))}"):
        gen = generate([p for _, _, p in calls], agents, budget, key)
    got.store(s, calls, gen, cfg, tokenizer)


def _score_step(got: _Collected, s: int, rows: np.ndarray, problems: Sequence[Problem], team: Team,
                graph: topo.Topology, score: ScoreFn, cfg: RolloutConfig) -> tuple[np.ndarray, np.ndarray]:
    """Score step ``s``'s answers of the live ``rows`` ``[n]`` (one transcript per row and
    answering agent; the team's score is their mean, every agent's own for independent learners)
    and mark the rows that end. Returns (terminal, truncated), ``[n]`` bool each."""
    answers = graph.answer_agents
    transcripts = [Transcript(problems[b], tuple(got.outputs[s][b]), a) for b in rows for a in answers]
    verdicts = list(score(transcripts))
    A = len(answers)
    reported = graph.reported_answerer(team.answer_agent)
    for j, v in enumerate(verdicts):
        b, a = rows[j // A], answers[j % A]
        if graph.independent:
            got.agent_score[s, b, a] = v.reward
        if a == reported:
            got.infos[s][b] = dict(v.info)
    rewards = np.array([v.reward for v in verdicts], np.float32).reshape(len(rows), A)
    got.score[s, rows] = rewards.mean(-1)
    if not graph.independent:   # a cooperative team: every agent shares the team's score
        got.agent_score[s, rows, :] = got.score[s, rows, None]
    success = got.score[s, rows] >= cfg.success_threshold
    term = success | (s == cfg.horizon - 1)
    trunc = ~term & (s == cfg.steps - 1)
    got.terminal[s, rows] = term
    got.truncated[s, rows] = trunc
    return term, trunc


def _build_trajectory(got: _Collected, *, pad_id: int, min_context_bucket: int,
                      group: RowGroup | None) -> Trajectory:
    """The :class:`Trajectory` of what the step loop collected: every context left-padded to the
    context bucket ``L`` (the power-of-two bucket, at least ``min_context_bucket``, of the longest
    context over the processes of ``group``), giving ``ctx_*``/``critic_ctx_*`` ``[S, B, N, L]`` and
    ``boot_ctx_*`` ``[B, N, L]``; responses ``[S, B, N, K]`` padded with ``pad_id`` past their
    lengths. The critic's contexts are the prompts except where it reads the joint history."""
    critic_ctx = got.critic_ctx or {}
    longest = max([len(p) for p in got.ctx.values()] + [len(p) for p in got.boot.values()]
                  + [len(p) for p in critic_ctx.values()] + [1])
    L = length_bucket(longest if group is None else group.max(longest), minimum=min_context_bucket)
    S, B, N, K = got.act.shape
    ctx_tokens, ctx_valid = _left_padded(got.ctx, (S, B, N), L, pad_id)
    boot_tokens, boot_valid = _left_padded(got.boot, (B, N), L, pad_id)
    critic_tokens = critic_valid = None
    if got.critic_ctx is not None:
        critic_tokens, critic_valid = _left_padded(critic_ctx, (S, B, N), L, pad_id, base=(ctx_tokens, ctx_valid))
    act_valid = np.arange(K)[None, None, None, :] < got.act_len[..., None]
    act = np.where(act_valid, got.act, pad_id).astype(np.int32)
    has = got.has_policy_logp
    traj = Trajectory(ctx_tokens=ctx_tokens, ctx_valid=ctx_valid, act_tokens=act, act_valid=act_valid,
                      sample_logp=got.logp, word_count=got.words, step_mask=got.step_mask, terminal=got.terminal,
                      truncated=got.truncated, score=got.score, agent_score=got.agent_score,
                      boot_ctx_tokens=boot_tokens, boot_ctx_valid=boot_valid, budget_clipped=got.clipped,
                      policy_logp=got.policy_logp if has else None, entropy=got.entropy if has else None,
                      critic_ctx_tokens=critic_tokens, critic_ctx_valid=critic_valid)
    traj.check()
    return traj


def _left_padded(contexts: dict[tuple[int, ...], list[int]], shape: tuple[int, ...], L: int, pad_id: int,
                 base: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [*shape, L] int32, valid [*shape, L] bool)`` with each context (keyed by its
    index into ``shape``) right-aligned; the other slots are ``pad_id`` / False, or copied from
    ``base``."""
    if base is None:
        tokens, valid = np.full((*shape, L), pad_id, np.int32), np.zeros((*shape, L), bool)
    else:
        tokens, valid = base[0].copy(), base[1].copy()
    for k, p in contexts.items():
        tokens[k], valid[k] = pad_id, False
        tokens[(*k, slice(L - len(p), None))] = p
        valid[(*k, slice(L - len(p), None))] = True
    return tokens, valid
