"""Agent profiles: each agent's role name and system prompt, and which agent answers.

Named profile sets ship with the package (docs/algorithm.md#profiles): ``math/single``, ``math/duo``,
``math/trio``, ``math/quad`` and the same for ``code/``, as YAML files under
``marft_jax/profiles/<kind>/<team>.yaml``; ``<kind>/<team>-anonymous`` (duo, trio, quad) are
built in code from the agent count (roles ``agent_1 ... agent_N``). :func:`load_profiles` takes
one of those names or the path of a YAML/JSON file with the same schema::

    name: my/team            # optional (default: the file name)
    kind: math               # math | code
    answer_agent: 1          # optional: index or role name of the answering agent; default last
    agents:
      - role: planner
        system_prompt: "..."
      - role: solver
        system_prompt: "..."
        parents: [planner]   # optional: the roles whose current-step outputs it reads

Without any ``parents`` the team graph comes from ``team.graph`` (default: the chain); with
``parents`` on any agent the set defines its own graph (agents without the key read nobody),
see :mod:`marft_jax.rl.topology`, which checks that graph (unknown roles, cycles, idle roles)
when the run's team is built (``train.build.build_team``, errors naming the profile).

:func:`validate` checks a set against the run's number of agents.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
from typing import Any

KINDS = ("math", "code")
TEAM_SIZES = {"duo": 2, "trio": 3, "quad": 4}
_KEYS = ("name", "kind", "answer_agent", "agents", "description")

ANONYMOUS_LINE = ("You are agent {k} of {n} in a sequential team working on the task. Read the "
                  "task and the messages of the agents before you, then continue the work.")
FINAL_ANSWER_SENTENCE = {
    "math": "Give the final answer in \\boxed{}.",
    "code": "Give the final complete program in a single ```python block.",
}


@dataclasses.dataclass(frozen=True)
class AgentProfile:
    role: str
    system_prompt: str


@dataclasses.dataclass(frozen=True)
class ProfileSet:
    """A team's profiles.

    Attributes:
      name: the package name (``math/duo``) or the file it came from.
      kind: ``"math"`` or ``"code"``.
      agents: one profile per agent, in execution order.
      answer_agent: index of the agent whose output is scored (default: the last).
      parents: ``{role: (roles it reads, ...)}`` when the file gives ``parents``, else None.
    """

    name: str
    kind: str
    agents: tuple[AgentProfile, ...]
    answer_agent: int
    parents: dict[str, tuple[str, ...]] | None = None

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(a.role for a in self.agents)

    @property
    def system_prompts(self) -> tuple[str, ...]:
        return tuple(a.system_prompt for a in self.agents)


def _profiles_root():
    return importlib.resources.files("marft_jax") / "profiles"


def available_profiles() -> list[str]:
    """Every name :func:`load_profiles` accepts without a path."""
    names = []
    root = _profiles_root()
    for kind in KINDS:
        folder = root / kind
        if folder.is_dir():
            names += [f"{kind}/{f.name[:-5]}" for f in folder.iterdir()
                      if f.name.endswith(".yaml")]
        names += [f"{kind}/{team}-anonymous" for team in TEAM_SIZES]
    return sorted(names)


def anonymous_profiles(kind: str, num_agents: int) -> ProfileSet:
    """``agent_1 ... agent_N`` with the anonymous line; the last adds the final-answer sentence."""
    if kind not in KINDS:
        raise ValueError(f"profile kind must be one of {KINDS}, got {kind!r}")
    if num_agents < 1:
        raise ValueError(f"num_agents must be >= 1, got {num_agents}")
    agents = []
    for k in range(1, num_agents + 1):
        prompt = ANONYMOUS_LINE.format(k=k, n=num_agents)
        if k == num_agents:
            prompt += " " + FINAL_ANSWER_SENTENCE[kind]
        agents.append(AgentProfile(role=f"agent_{k}", system_prompt=prompt))
    team = {v: k for k, v in TEAM_SIZES.items()}.get(num_agents, str(num_agents))
    return ProfileSet(name=f"{kind}/{team}-anonymous", kind=kind, agents=tuple(agents),
                      answer_agent=num_agents - 1)


def _from_dict(doc: Any, source: str) -> ProfileSet:
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a profile set must be a mapping with 'kind' and 'agents', "
                         f"got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {list(_KEYS)}")
    for key in ("kind", "agents"):
        if key not in doc:
            raise ValueError(f"{source}: missing '{key}'")
    if not isinstance(doc["agents"], list):
        raise ValueError(f"{source}: 'agents' must be a list, got {type(doc['agents']).__name__}")
    agents = []
    parents: dict[str, tuple[str, ...]] = {}
    has_parents = any(isinstance(e, dict) and "parents" in e for e in doc["agents"])
    for i, entry in enumerate(doc["agents"]):
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: agents[{i}] must be a mapping with 'role' and "
                             f"'system_prompt', got {type(entry).__name__}")
        extra = sorted(set(entry) - {"role", "system_prompt", "parents"})
        if extra:
            raise ValueError(f"{source}: agents[{i}] has unknown key(s) {extra}")
        for key in ("role", "system_prompt"):
            if key not in entry:
                raise ValueError(f"{source}: agents[{i}] is missing '{key}'")
            if not isinstance(entry[key], str):
                raise ValueError(f"{source}: agents[{i}].{key} must be a string, "
                                 f"got {type(entry[key]).__name__}")
        agents.append(AgentProfile(role=entry["role"], system_prompt=entry["system_prompt"]))
        if "parents" in entry:
            ps = entry["parents"]
            if not isinstance(ps, list) or not all(isinstance(p, str) for p in ps):
                raise ValueError(f"{source}: agents[{i}].parents must be a list of role names, got {ps!r}")
            parents[entry["role"]] = tuple(ps)
    answer = doc.get("answer_agent", len(agents) - 1)
    if isinstance(answer, str):
        roles = [a.role for a in agents]
        if answer not in roles:
            raise ValueError(f"{source}: answer_agent {answer!r} names no agent; roles: {roles}")
        answer = roles.index(answer)
    return ProfileSet(name=str(doc.get("name", source)), kind=doc["kind"], agents=tuple(agents),
                      answer_agent=answer, parents=parents if has_parents else None)


def _parse(text: str, source: str, as_json: bool) -> Any:
    if as_json:
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: invalid JSON ({e})") from None
    import yaml
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{source}: invalid YAML ({e})") from None


def load_profiles(name_or_path: str | os.PathLike) -> ProfileSet:
    """A profile set by package name (see :func:`available_profiles`) or from a YAML/JSON file.

    Raises ``ValueError`` for an unknown name (listing the available ones) or a malformed set,
    ``FileNotFoundError`` for a missing ``.yaml``/``.yml``/``.json`` path.
    """
    spec = os.fspath(name_or_path)
    kind, _, team = spec.partition("/")
    if kind in KINDS and team.endswith("-anonymous") and team[:-10] in TEAM_SIZES:
        return validate(anonymous_profiles(kind, TEAM_SIZES[team[:-10]]))
    if kind in KINDS and team and "/" not in team:
        resource = _profiles_root() / kind / f"{team}.yaml"
        if resource.is_file():
            ps = _from_dict(_parse(resource.read_text(encoding="utf-8"), spec, False), spec)
            return validate(ps)
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            doc = _parse(f.read(), spec, spec.lower().endswith(".json"))
        if isinstance(doc, dict) and "name" not in doc:
            doc = {**doc, "name": spec}
        return validate(_from_dict(doc, spec))
    if spec.lower().endswith((".yaml", ".yml", ".json")):
        raise FileNotFoundError(f"profile file not found: {spec}")
    raise ValueError(f"unknown profile set {spec!r}; available: {', '.join(available_profiles())}"
                     " (or give the path of a .yaml/.json file)")


def validate(profiles: ProfileSet, num_agents: int | None = None) -> ProfileSet:
    """Check ``profiles`` (and, if given, that it has ``num_agents`` agents); returns it."""
    where = f"profile set {profiles.name!r}"
    n = len(profiles.agents)
    if num_agents is not None and n != num_agents:
        raise ValueError(f"{where} defines {n} agent(s) but the run has num_agents={num_agents}")
    if n == 0:
        raise ValueError(f"{where} defines no agents")
    if profiles.kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {KINDS}, got {profiles.kind!r}")
    for i, agent in enumerate(profiles.agents):
        if not agent.role.strip():
            raise ValueError(f"{where}: agents[{i}] has an empty role name")
        if not agent.system_prompt.strip():
            raise ValueError(f"{where}: agents[{i}] ({agent.role!r}) has an empty system_prompt")
    roles = [a.role for a in profiles.agents]
    duplicates = sorted({r for r in roles if roles.count(r) > 1})
    if duplicates:
        raise ValueError(f"{where}: duplicate role name(s) {duplicates}; roles must be unique")
    answer = profiles.answer_agent
    if answer is None:
        raise ValueError(f"{where}: answer_agent is undefined")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise ValueError(f"{where}: answer_agent must be an agent index or role name, "
                         f"got {answer!r}")
    if not 0 <= answer < n:
        raise ValueError(f"{where}: answer_agent={answer} is out of range for {n} agent(s) "
                         f"(valid: 0..{n - 1})")
    return profiles
