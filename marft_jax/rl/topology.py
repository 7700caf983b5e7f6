"""The team's dependency graph (Flex-MG's 𝒟): who reads whom, in which layers agents act, who
answers, and the decision-point link table the backups follow.

A :class:`Topology` holds, per agent (indexed in execution order, the canonical agent axis),
the agents whose outputs of the current step it reads (``parents``, all with a smaller index).
Outputs of finished steps are always visible to every agent (multi-step episodes keep the
history). From the parents follow:

* ``layers``: agent ``i`` acts in layer ``1 + max(layer of its parents)`` (layer 0 without
  parents); the rollout makes one batched sampler call per layer (per-row adapter ids).
* the answering agents, whose outputs are scored (their mean is the team's score).
* :meth:`Topology.links`, the backup's successor table (:class:`LinkTable`).
* what the rollout and the backups read from it besides the parents: the joint-history critic
  contexts (:meth:`Topology.joint_critic_agents`, :meth:`Topology.joint_reads`), the agents whose
  next-step state bootstraps a truncated episode (:attr:`Topology.bootstrap_agents`,
  :attr:`Topology.bootstrap_agent`) and the answerer whose scorer info is recorded
  (:meth:`Topology.reported_answerer`).

Named graphs (``team.graph``):

* ``chain`` (MARFT): agent i reads agents 0 .. i-1; N layers of one agent; the last answers.
* ``independent`` (independent PPO / MAPoRL-style baseline): nobody reads anybody; one layer;
  every agent answers and learns from its own reward and its own decision points.
* ``mixture`` (mixture-of-agents): agents 0 .. N-2 propose in one layer, the last aggregates
  them all and answers.
* ``debate``: one layer of N debaters per step; each round (step) every agent sees all outputs
  of the rounds before (the history); every agent answers, the team's score is their mean.

A profile file may instead give ``parents`` per role (role names), see
:func:`from_parents`. Every violation is a :class:`TopologyError` naming the roles involved.

**Links between agents of one layer** (``team.layer_links``):

* ``chain`` (default): decision points are linked in execution order (agent index), as in
  MARFT's chain, whatever the graph. With the critic's state at agent i being the joint
  history (task, earlier steps and the outputs of agents 0 .. i-1 of the step; see
  :meth:`Topology.critic_reads_all_earlier`), agent i's advantage is the i-th term of the
  multi-agent advantage decomposition ``A(s, a^{0:N-1}) = Σ_i A(s, a^{0:i-1}, a^i)``, which
  holds for *any* agent order; so the sequential (HAPPO) update keeps its monotonic-improvement
  argument on every DAG, the graph only restricting what each policy conditions on.
* ``layer``: every agent of a layer links to the layer's successor (the first agent with
  tokens of the next layer, or of the next step's first layer) and the critic reads each
  agent's own context (``backups.marft_gae(links=...)``, ``rewards.place_reward(links=...)``
  consume the table on every implementation). Cheaper (no joint-state contexts) and symmetric
  between siblings, but
  each sibling's advantage then also carries the other siblings' effect on the next layer's
  value: the decomposition above no longer sums to the joint advantage.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import numpy as np

from marft_jax.config import ConfigError

GRAPHS = ("chain", "independent", "mixture", "debate")
LAYER_LINKS = ("chain", "layer")


class TopologyError(ValueError):
    """An invalid team graph; the message names the roles involved."""


def check_team_keys(graph: str | None, layer_links: str, mode: str) -> None:
    """Raise :class:`~marft_jax.config.ConfigError` naming ``team.graph`` (one of :data:`GRAPHS`
    or None, and the independent graph alone under ``rollout.mode=parallel``) or
    ``team.layer_links`` (one of :data:`LAYER_LINKS`); called at build (``train.build.check_names``)."""
    if graph is not None:
        if graph not in GRAPHS:
            raise ConfigError(f"team.graph={graph!r}: must be one of {list(GRAPHS)} or null (the profile's own "
                              "'parents', else chain)")
        if mode != "sequential" and graph != "independent":
            raise ConfigError(f"team.graph={graph!r}: must be compatible with rollout.mode={mode!r} (parallel is "
                              "the independent graph; set team.graph alone)")
    if layer_links not in LAYER_LINKS:
        raise ConfigError(f"team.layer_links={layer_links!r}: must be one of {list(LAYER_LINKS)}")


@dataclasses.dataclass(frozen=True)
class LinkTable:
    """Successors of response chunks (one chunk = one agent's response at one step).

    Chunks are flattened in execution order: chunk ``c = s * N + i``; ``C = S * N`` is the
    virtual end of the row (value ``V_end``, advantage 0).

    Attributes:
      kind: ``"chain"`` (every successor is the next chunk: the flat execution-order
        recurrence), ``"per_agent"`` (agent i's successor is agent i at the next step:
        independent PPO), or ``"table"`` (anything else).
      succ: ``[S, N]`` int, the chunk that a response's last decision point links to.
      skip: ``[S, N]`` int, where a chunk *without* tokens forwards its link (so a link never
        lands on an empty response).
      succ_crosses, skip_crosses: ``[S, N]`` bool, the link leaves step s (so it is cut when s
        is terminal).
    """

    kind: str
    succ: np.ndarray
    skip: np.ndarray
    succ_crosses: np.ndarray
    skip_crosses: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.succ.shape[0])

    @property
    def num_agents(self) -> int:
        return int(self.succ.shape[1])

    def _key(self) -> tuple:
        return (self.kind, self.succ.shape) + tuple(
            np.asarray(x, np.int64).tobytes()
            for x in (self.succ, self.skip, self.succ_crosses, self.skip_crosses))

    def __hash__(self) -> int:   # static argument of jitted programs
        return hash(self._key())

    def __eq__(self, other) -> bool:
        return isinstance(other, LinkTable) and self._key() == other._key()


def per_agent_links(num_steps: int, num_agents: int) -> LinkTable:
    """The independent graph's table: agent i's response at step s links to agent i's at step
    s+1 (the last step: to the end), every link leaving its step (cut when the step is terminal).
    Each agent's sequence ends at its own bootstrap value (``backups.marft_gae``)."""
    S, N = num_steps, num_agents
    c = np.arange(S * N).reshape(S, N)
    nxt = np.where(np.arange(S)[:, None] < S - 1, c + N, S * N)
    return LinkTable("per_agent", nxt, nxt.copy(), np.ones((S, N), bool), np.ones((S, N), bool))


@dataclasses.dataclass(frozen=True)
class Topology:
    """A team's dependency graph.

    Attributes:
      name: the graph's name (``chain``, ``mixture``, ... or ``profile`` for explicit parents).
      roles: one role name per agent, in execution order.
      parents: per agent, the indices (all smaller) of the agents whose current-step outputs it
        reads.
      answer_agents: the agents whose outputs are scored.
      independent: independent learners (own rewards, own decision-point sequences).
    """

    name: str
    roles: tuple[str, ...]
    parents: tuple[tuple[int, ...], ...]
    answer_agents: tuple[int, ...]
    independent: bool = False

    def __post_init__(self) -> None:
        _check(self)

    @property
    def num_agents(self) -> int:
        return len(self.roles)

    @functools.cached_property
    def layer_of(self) -> tuple[int, ...]:
        depth: list[int] = []
        for ps in self.parents:
            depth.append(1 + max((depth[p] for p in ps), default=-1))
        return tuple(depth)

    @functools.cached_property
    def layers(self) -> tuple[tuple[int, ...], ...]:
        """Agents per layer, each in execution order; one sampler call per layer."""
        n = max(self.layer_of) + 1
        return tuple(tuple(i for i, l in enumerate(self.layer_of) if l == k) for k in range(n))

    @property
    def is_chain(self) -> bool:
        """MARFT's chain: agent i reads every agent before it."""
        return not self.independent and all(p == tuple(range(i)) for i, p in enumerate(self.parents))

    @property
    def answer_agent(self) -> int:
        """The last answering agent (the one whose scorer info is logged, except for independent
        learners: :meth:`reported_answerer`)."""
        return self.answer_agents[-1]

    def reported_answerer(self, team_answer: int) -> int:
        """The answering agent whose scorer info the rollout records per (step, row): for
        independent learners, where every agent answers, the team's own answering agent
        ``team_answer`` (the profile's or ``team.answer_agent``); else :attr:`answer_agent`."""
        return team_answer if self.independent else self.answer_agent

    @property
    def bootstrap_agents(self) -> tuple[int, ...]:
        """The agents whose context at step ``s + 1`` (the task and the history, no current-step
        outputs) bootstraps an episode truncated after step ``s``: every agent for independent
        learners (each backs up its own decision points to its own value), else
        (:attr:`bootstrap_agent`,)."""
        if self.independent:
            return tuple(range(self.num_agents))
        return (self.bootstrap_agent,)

    @property
    def bootstrap_agent(self) -> int:
        """A shared-reward team's bootstrap agent: the first agent of the first layer (agent 0,
        which reads nobody), where the last layer's links land at the next step (:meth:`links`);
        its value at step ``s + 1`` bootstraps a row truncated after step ``s``. Independent
        learners have one per agent (:attr:`bootstrap_agents`): asking them for one is an error."""
        if self.independent:
            raise ValueError(f"graph {self.name!r}: independent learners bootstrap every agent from its own "
                             "context; use Topology.bootstrap_agents")
        return self.layers[0][0]

    def joint_reads(self, agent: int) -> tuple[int, ...]:
        """The agents whose current-step outputs the joint-history state at ``agent`` reads (the
        critic's context when :meth:`critic_reads_all_earlier`): every agent before it in execution
        order, ``0 .. agent-1``, whatever its parents, in that order."""
        return tuple(range(agent))

    def joint_critic_agents(self, layer_links: str) -> tuple[int, ...]:
        """The agents whose critic state is the joint history (:meth:`joint_reads`) instead of their
        own prompt: when :meth:`critic_reads_all_earlier`, those whose parents are not already every
        earlier agent; () otherwise."""
        if not self.critic_reads_all_earlier(layer_links):
            return ()
        return tuple(i for i, ps in enumerate(self.parents) if ps != self.joint_reads(i))

    def critic_reads_all_earlier(self, layer_links: str) -> bool:
        """Whether the critic's state at agent i needs a context other than agent i's own: the
        joint history of agents 0 .. i-1 (``layer_links="chain"`` on a graph that is not the
        chain)."""
        return layer_links == "chain" and not self.independent and not self.is_chain

    def links(self, num_steps: int, layer_links: str = "chain") -> LinkTable:
        """The backup's link table for ``num_steps`` steps (module doc)."""
        if layer_links not in LAYER_LINKS:
            raise ValueError(f"team.layer_links must be one of {LAYER_LINKS}, got {layer_links!r}")
        S, N = num_steps, self.num_agents
        if self.independent:
            return per_agent_links(S, N)
        end = S * N
        c = np.arange(end).reshape(S, N)
        chained = np.minimum(c + 1, end)
        chain_cross = np.broadcast_to(np.arange(N) == N - 1, (S, N)).copy()
        if layer_links == "chain" or len(self.layers) == N:
            return LinkTable("chain", chained, chained.copy(), chain_cross, chain_cross.copy())
        succ = np.zeros((S, N), np.int64)
        skip = np.zeros((S, N), np.int64)
        succ_x = np.zeros((S, N), bool)
        skip_x = np.zeros((S, N), bool)
        first = [layer[0] for layer in self.layers]
        for s in range(S):
            for k, layer in enumerate(self.layers):
                if k + 1 < len(self.layers):
                    target, crosses = s * N + first[k + 1], False
                else:
                    target, crosses = ((s + 1) * N + first[0], True) if s + 1 < S else (end, True)
                for pos, i in enumerate(layer):
                    succ[s, i], succ_x[s, i] = target, crosses
                    if pos + 1 < len(layer):
                        skip[s, i], skip_x[s, i] = s * N + layer[pos + 1], False
                    else:
                        skip[s, i], skip_x[s, i] = target, crosses
        return LinkTable("table", succ, skip, succ_x, skip_x)

    def reward_receivers(self, layer_links: str) -> np.ndarray | None:
        """``[N]`` bool: agents that each get a copy of the team reward at the final step
        (``layer`` links: every agent of the last layer, which all link to the episode's end),
        or None for the chained placement (the last valid decision point of the final step)."""
        if self.independent or layer_links == "chain" or len(self.layers[-1]) == 1:
            return None
        return np.isin(np.arange(self.num_agents), self.layers[-1])

    def describe(self) -> str:
        """One line per layer, e.g. ``layer 0: proposer_a, proposer_b | layer 1: aggregator <- ...``."""
        parts = []
        for k, layer in enumerate(self.layers):
            names = []
            for i in layer:
                ps = self.parents[i]
                names.append(self.roles[i] + (f" <- {', '.join(self.roles[p] for p in ps)}" if ps else ""))
            parts.append(f"layer {k}: " + "; ".join(names))
        return " | ".join(parts)


def _cycle(names: Sequence[str], parents: Mapping[str, Sequence[str]]) -> list[str] | None:
    """A cycle in the read graph as role names, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(r: str) -> list[str] | None:
        state[r] = 1
        stack.append(r)
        for p in parents.get(r, ()):
            if state.get(p) == 1:
                return stack[stack.index(p):] + [p]
            if p not in state:
                found = visit(p)
                if found:
                    return found
        stack.pop()
        state[r] = 2
        return None

    for r in names:
        if r not in state:
            found = visit(r)
            if found:
                return found
    return None


def _check(t: Topology) -> None:
    n = len(t.roles)
    if n == 0:
        raise TopologyError("the team graph has no agents")
    if len(t.parents) != n:
        raise TopologyError(f"graph {t.name!r}: {len(t.parents)} parent lists for {n} roles {list(t.roles)}")
    for i, ps in enumerate(t.parents):
        for p in ps:
            if not 0 <= p < i:
                raise TopologyError(
                    f"graph {t.name!r}: role {t.roles[i]!r} reads {t.roles[p] if 0 <= p < n else p!r}, "
                    "which does not act before it; list the roles in execution order (every role after "
                    "the roles it reads)")
    if not t.answer_agents or any(not 0 <= a < n for a in t.answer_agents):
        raise TopologyError(f"graph {t.name!r}: answering agent(s) {list(t.answer_agents)} out of range "
                            f"for roles {list(t.roles)}")
    read = {p for ps in t.parents for p in ps}
    idle = [t.roles[i] for i in range(n) if i not in read and i not in t.answer_agents]
    # The named chain keeps accepting any answering agent (team.answer_agent): agents after it
    # still act, and learn from the shared reward through the chained links.
    if idle and t.name != "chain":
        raise TopologyError(f"graph {t.name!r}: role(s) {idle} are read by no role and do not answer "
                            f"(answering: {[t.roles[a] for a in t.answer_agents]}); give them a reader "
                            "or drop them")


def named(graph: str, roles: Sequence[str], answer_agent: int | None = None) -> Topology:
    """A named graph (:data:`GRAPHS`) over ``roles``.

    ``answer_agent`` (the profile's) applies to ``chain``; ``mixture`` answers with its
    aggregator (the last role); ``independent`` and ``debate`` with every agent.
    """
    roles = tuple(roles)
    n = len(roles)
    if graph == "chain":
        answer = n - 1 if answer_agent is None else answer_agent
        return Topology("chain", roles, tuple(tuple(range(i)) for i in range(n)), (answer,))
    if graph == "independent":
        return Topology("independent", roles, ((),) * n, tuple(range(n)), independent=True)
    if graph == "debate":
        return Topology("debate", roles, ((),) * n, tuple(range(n)))
    if graph == "mixture":
        if n < 3:
            raise TopologyError(f"graph 'mixture' needs at least 3 agents (proposers, then an aggregator), "
                                f"got {n}: {list(roles)}")
        if answer_agent is not None and answer_agent != n - 1:
            raise TopologyError(f"graph 'mixture' answers with its aggregator {roles[-1]!r}, but the "
                                f"profile's answer_agent is {roles[answer_agent]!r}")
        return Topology("mixture", roles, ((),) * (n - 1) + (tuple(range(n - 1)),), (n - 1,))
    raise TopologyError(f"unknown team.graph {graph!r}; named graphs: {list(GRAPHS)} "
                        "(or give 'parents' per role in the profile file)")


def from_parents(parents: Mapping[str, Sequence[str]], roles: Sequence[str],
                 answer_agents: Sequence[str], *, source: str = "profile") -> Topology:
    """A graph from explicit ``{role: [roles it reads]}`` (roles absent from the mapping read
    nobody). Errors name the unknown roles, the cycle, or the idle roles."""
    roles = tuple(roles)
    unknown = sorted({r for r in parents if r not in roles}
                     | {p for ps in parents.values() for p in ps if p not in roles})
    if unknown:
        raise TopologyError(f"{source}: parents name unknown role(s) {unknown}; roles: {list(roles)}")
    cycle = _cycle(roles, parents)
    if cycle:
        raise TopologyError(f"{source}: the graph has a cycle: {' -> '.join(cycle)} (read as 'reads')")
    bad_answer = [a for a in answer_agents if a not in roles]
    if bad_answer:
        raise TopologyError(f"{source}: answering role(s) {bad_answer} unknown; roles: {list(roles)}")
    index = {r: i for i, r in enumerate(roles)}
    ps = tuple(tuple(sorted(index[p] for p in parents.get(r, ()))) for r in roles)
    return Topology("profile", roles, ps, tuple(sorted(index[a] for a in answer_agents)))


def resolve(graph: str | None, *, roles: Sequence[str], answer_agent: int, profile_parents=None,
            profile_answers: Sequence[str] | None = None, num_agents: int | None = None,
            mode: str = "sequential", source: str = "team.graph") -> Topology:
    """The run's topology from ``team.graph``, the profile's own graph and ``rollout.mode``.

    ``graph=None`` takes the profile's ``parents`` if it has them, else ``chain`` for
    ``rollout.mode=sequential`` and ``independent`` for ``parallel``. A graph whose agent count
    differs from ``num_agents`` is an error naming both.
    """
    roles = tuple(roles)
    if num_agents is not None and len(roles) != num_agents:
        raise TopologyError(f"{source}: the team's roles {list(roles)} are {len(roles)} agent(s), but "
                            f"team.num_agents={num_agents}")
    if graph is None and profile_parents is not None:
        answers = profile_answers or [roles[answer_agent]]
        return from_parents(profile_parents, roles, answers, source=source)
    if graph is None:
        graph = "independent" if mode == "parallel" else "chain"
    if profile_parents is not None:
        raise TopologyError(f"{source}={graph!r} conflicts with the profile's own 'parents'; unset one")
    if mode == "parallel" and graph != "independent":
        raise TopologyError(f"rollout.mode=parallel is independent PPO; it conflicts with {source}={graph!r} "
                            "(set team.graph alone)")
    return named(graph, roles, None if graph in ("independent", "debate") else answer_agent)
