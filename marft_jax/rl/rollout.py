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
``max_steps`` cuts them (truncated, bootstrapped from agent 0's next-step context).

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
    B, N, S = len(problems), team.num_agents, cfg.steps
    graph = team.graph(cfg.mode)
    if graph.num_agents != N:
        raise ValueError(f"the team graph has {graph.num_agents} agents, the team {N}")
    calls_made = steps_played = overflow_truncated = 0
    ended_rows: list[int] = []
    anyone = (lambda flag: flag) if group is None else group.any
    # agents whose critic state is the joint history, not their own context
    joint = [i for i in range(N)
             if graph.critic_reads_all_earlier(team.layer_links) and graph.parents[i] != tuple(range(i))]
    critic_ctx: dict[tuple[int, int, int], list[int]] = {}
    K = max(cfg.budget(i) for i in range(N))
    ctx: dict[tuple[int, int, int], list[int]] = {}
    act = np.zeros((S, B, N, K), np.int32)
    act_len = np.zeros((S, B, N), np.int32)
    logp = np.zeros((S, B, N, K), np.float32)
    policy_logp = np.zeros((S, B, N, K), np.float32)
    entropy = np.zeros((S, B, N, K), np.float32)
    has_policy_logp = True
    words = np.zeros((S, B, N), np.int32)
    clipped = np.zeros((S, B, N), bool)
    step_mask = np.zeros((S, B), bool)
    terminal = np.zeros((S, B), bool)
    truncated = np.zeros((S, B), bool)
    score_arr = np.zeros((S, B), np.float32)
    agent_score = np.zeros((S, B, N), np.float32)
    outputs = [[["" for _ in range(N)] for _ in range(B)] for _ in range(S)]
    infos: list[list[dict]] = [[{} for _ in range(B)] for _ in range(S)]
    history: list[list[StepRecord]] = [[] for _ in range(B)]
    active = np.ones(B, bool)
    boot: dict[tuple[int, int], list[int]] = {}

    def prompt_for(b: int, i: int, s: int, current: dict[int, str]) -> list[int] | None:
        """Agent i's prompt at step s of row b under ``rollout.overflow``; None: it does not fit
        and the episode ends (``end_episode``)."""
        nonlocal overflow_truncated
        if cfg.overflow == "error" or (cfg.overflow == "end_episode" and s > 0):
            p = _context(team, problems[b], i, history[b], current, cfg, tokenizer)
            if len(p) + min_budget(cfg, i) <= cfg.context_window:
                return p
            if cfg.overflow == "error":
                raise _overflow_error(team, problems[b], p, cfg, row=b, agent=i, step=s)
            return None
        p, dropped = _fitted(team, problems[b], i, history[b], current, cfg, tokenizer, row=b, step=s)
        overflow_truncated += dropped > 0
        return p

    def state(b: int, i: int, s: int, current: dict[int, str]) -> list[int]:
        """A context that is not sampled (the bootstrap state, the critic's joint history):
        fitted as a prompt would be, except under ``error``, which leaves it as built."""
        if cfg.overflow == "error":
            return _context(team, problems[b], i, history[b], current, cfg, tokenizer)
        return _fitted(team, problems[b], i, history[b], current, cfg, tokenizer, row=b, step=s)[0]

    def discard(s: int, b: int) -> None:
        """Forget what row b's agents sampled at step s (the episode ended before it)."""
        for a in range(N):
            ctx.pop((s, b, a), None)
            outputs[s][b][a] = ""
        for x in (act, act_len, logp, policy_logp, entropy, words, clipped):
            x[s, b] = 0

    def run(calls: list[tuple[int, int, list[int]]], s: int, k: jax.Array) -> None:
        """Generate for (row, agent, prompt) triples and store the results at step s."""
        agents = np.array([a for _, a, _ in calls], np.int32)
        budget = max((cfg.budget(a) for a in agents), default=0)   # no calls: this process has no live row
        nonlocal has_policy_logp, calls_made
        calls_made += 1
        with jax.profiler.TraceAnnotation(f"rollout/step{s}/agents{'+'.join(map(str, sorted(set(agents.tolist()))))}"):
            gen = generate([p for _, _, p in calls], agents, budget, k)
        has_policy_logp = has_policy_logp and gen.policy_logp is not None and gen.entropy is not None
        for j, (b, a, prompt) in enumerate(calls):
            ctx[(s, b, a)] = prompt
            limit = min(cfg.budget(a), max(cfg.context_window - len(prompt), 1))
            n = int(min(gen.lengths[j], limit))
            act[s, b, a, :n] = gen.tokens[j, :n]
            logp[s, b, a, :n] = gen.logp[j, :n]
            if has_policy_logp:
                policy_logp[s, b, a, :n] = gen.policy_logp[j, :n]
                entropy[s, b, a, :n] = gen.entropy[j, :n]
            act_len[s, b, a] = n
            clipped[s, b, a] = n >= limit and (n == 0 or int(gen.tokens[j, n - 1]) not in tokenizer.stop_ids)
            text = tokenizer.decode(gen.tokens[j, :n]).rstrip()
            outputs[s][b][a] = text
            words[s, b, a] = len(text.split())

    for s in range(S):
        rows = np.flatnonzero(active)
        if not anyone(rows.size > 0):
            break
        steps_played += 1
        key, *agent_keys = jax.random.split(key, N + 1)
        ended: list[int] = []        # rows whose step-s prompts do not fit (end_episode)
        for layer in graph.layers:   # a layer samples with its first agent's key
            calls = []
            for b in rows:
                if b in ended:
                    continue
                mine = [(b, i, prompt_for(b, i, s, {j: outputs[s][b][j] for j in graph.parents[i]})) for i in layer]
                if any(p is None for _, _, p in mine):
                    ended.append(b)
                else:
                    calls += mine
            # end_episode can leave a layer without prompts: skip its call if every process has none
            if cfg.overflow != "end_episode" or anyone(bool(calls)):
                run(calls, s, agent_keys[layer[0]])
        for b in ended:              # truncated after step s - 1, bootstrapped from agent 0's step-s state
            discard(s, b)
            truncated[s - 1, b] = True
            for i in (range(N) if graph.independent else [0]):
                boot[(b, i)] = state(b, i, s, {})
        ended_rows.extend(ended)
        active[ended] = False
        rows = np.array([b for b in rows if b not in ended], np.int64)
        step_mask[s, rows] = True
        for b in rows:
            for i in joint:
                critic_ctx[(s, b, i)] = state(b, i, s, {j: outputs[s][b][j] for j in range(i)})

        answers = graph.answer_agents
        transcripts = [Transcript(problems[b], tuple(outputs[s][b]), a) for b in rows for a in answers]
        verdicts = list(score(transcripts))
        A = len(answers)
        for j, v in enumerate(verdicts):
            b, a = rows[j // A], answers[j % A]
            if graph.independent:
                agent_score[s, b, a] = v.reward
            if a == (team.answer_agent if graph.independent else graph.answer_agent):
                infos[s][b] = dict(v.info)
        rewards = np.array([v.reward for v in verdicts], np.float32).reshape(len(rows), A)
        score_arr[s, rows] = rewards.mean(-1)
        if not graph.independent:   # a cooperative team: every agent shares the team's score
            agent_score[s, rows, :] = score_arr[s, rows, None]
        success = score_arr[s, rows] >= cfg.success_threshold

        last_allowed = s == cfg.horizon - 1
        term = success | last_allowed
        trunc = ~term & (s == S - 1)
        terminal[s, rows] = term
        truncated[s, rows] = trunc
        for j, b in enumerate(rows):
            history[b].append(StepRecord(tuple(outputs[s][b]), None if term[j] else feedback))
            if trunc[j]:
                for i in (range(N) if graph.independent else [0]):
                    boot[(b, i)] = state(b, i, s + 1, {})
        active[rows[term | trunc]] = False

    longest = max([len(p) for p in ctx.values()] + [len(p) for p in boot.values()]
                  + [len(p) for p in critic_ctx.values()] + [1])
    L = length_bucket(longest if group is None else group.max(longest), minimum=min_context_bucket)
    pad = tokenizer.pad_id
    ctx_tokens = np.full((S, B, N, L), pad, np.int32)
    ctx_valid = np.zeros((S, B, N, L), bool)
    for (s, b, a), p in ctx.items():
        ctx_tokens[s, b, a, L - len(p):] = p
        ctx_valid[s, b, a, L - len(p):] = True
    boot_tokens = np.full((B, N, L), pad, np.int32)
    boot_valid = np.zeros((B, N, L), bool)
    for (b, i), p in boot.items():
        boot_tokens[b, i, L - len(p):] = p
        boot_valid[b, i, L - len(p):] = True
    critic_tokens = critic_valid = None
    if joint:
        critic_tokens, critic_valid = ctx_tokens.copy(), ctx_valid.copy()
        for (s, b, a), p in critic_ctx.items():
            critic_tokens[s, b, a] = pad
            critic_valid[s, b, a] = False
            critic_tokens[s, b, a, L - len(p):] = p
            critic_valid[s, b, a, L - len(p):] = True
    act_valid = np.arange(K)[None, None, None, :] < act_len[..., None]
    act = np.where(act_valid, act, pad).astype(np.int32)
    traj = Trajectory(ctx_tokens=ctx_tokens, ctx_valid=ctx_valid, act_tokens=act, act_valid=act_valid,
                      sample_logp=logp, word_count=words, step_mask=step_mask, terminal=terminal,
                      truncated=truncated, score=score_arr, agent_score=agent_score,
                      boot_ctx_tokens=boot_tokens, boot_ctx_valid=boot_valid, budget_clipped=clipped,
                      policy_logp=policy_logp if has_policy_logp else None,
                      entropy=entropy if has_policy_logp else None,
                      critic_ctx_tokens=critic_tokens, critic_ctx_valid=critic_valid)
    traj.check()
    return traj, RolloutTexts(outputs=outputs, infos=infos, sampler_calls=calls_made / max(steps_played, 1),
                              overflow_truncated=overflow_truncated, overflow_ended=len(ended_rows))
