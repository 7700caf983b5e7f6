"""Profiles: the shipped wording matches reference §11, names resolve, errors are clear."""

from __future__ import annotations

import dataclasses
import json

import pytest

from marft_jax.envs.profiles import (AgentProfile, ProfileSet, available_profiles,
                                     load_profiles, validate)

# Reference §11, copied verbatim (the trusted reference for the shipped files).
TEAM_LINE = ("You are the {Role} in a team of {N} members who work on a {task} one after "
             "another: {chain}. You see the task and the messages of the teammates before you.")
ANON = ("You are agent {k} of {N} in a sequential team working on the task. Read the task and "
        "the messages of the agents before you, then continue the work.")
MATH_FINAL = "Give the final answer in \\boxed{}."
CODE_FINAL = "Give the final complete program in a single ```python block."

PLANNER_M = ("Write a short numbered plan for solving the problem. Do not calculate and do not "
             "give a final answer.")
SOLVER = ("Carry out the plan step by step and show the calculations. Give the final answer in "
          "\\boxed{}.")
PLANNER_C = ("Describe the algorithm, data structures, input/output handling, edge cases and "
             "time complexity. Do not write code.")
CODER = ("Implement the plan as a complete Python 3 program. Give the program in a single "
         "```python block.")
EXPECTED = {
    "math/duo": [("planner", PLANNER_M), ("solver", SOLVER)],
    "math/trio": [
        ("reasoner", "Work out what is asked, which facts matter and which strategy fits. "
                     "Do not compute the result."),
        ("actor", "Follow the reasoner's strategy and work the solution out in full, with "
                  "every calculation."),
        ("verifier", "Check the actor's work, for example by substituting back or by another "
                     "method, and fix any error. Give the final answer in \\boxed{}."),
    ],
    "math/dual": [  # G1's sample-run team (reasoner -> actor); the actor answers
        ("reasoner", "Work out what is asked, which facts matter and which strategy fits. "
                     "Do not compute the result."),
        ("actor", "Follow the reasoner's strategy and work the solution out in full, with "
                  "every calculation. " + MATH_FINAL),
    ],
    "math/quad": [
        ("decomposer", "Split the problem into smaller sub-questions as a numbered list. "
                       "Do not solve them."),
        ("planner", "For each sub-question, name the method to use and the order of work. "
                    "Do not compute."),
        ("executor", "Solve the sub-questions in order, following the plan, and show the "
                     "calculations."),
        ("verifier", "Review the executor's work, correct any mistake, and give the final "
                     "answer in \\boxed{}."),
    ],
    "code/duo": [("planner", PLANNER_C), ("coder", CODER)],
    "code/trio": [
        ("planner", PLANNER_C), ("coder", CODER),
        ("debugger", "Review the coder's program against the task and the edge cases, trace it "
                     "on the examples, and fix any bug. Give the final complete program in a "
                     "single ```python block."),
    ],
    "code/quad": [
        ("planner", PLANNER_C), ("coder", CODER),
        ("tester", "Design test inputs, including edge cases, trace the program on them and "
                   "report every failure with the expected output. Do not rewrite the program."),
        ("debugger", "Fix the failures the tester reported and any other bug. Give the final "
                     "complete program in a single ```python block."),
    ],
}
TASK = {"math": "math problem", "code": "programming task"}


def test_all_names_resolve():
    names = available_profiles()
    for kind in ("math", "code"):
        for team in ("single", "duo", "trio", "quad", "duo-anonymous", "trio-anonymous",
                     "quad-anonymous"):
            assert f"{kind}/{team}" in names
    assert "math/dual" in names            # the reference G1 sample run's team
    for name in names:
        ps = load_profiles(name)
        assert ps.name == name and ps.kind == name.split("/")[0]
        assert ps.answer_agent == ps.num_agents - 1


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_team_wording_matches_reference(name):
    kind = name.split("/")[0]
    expected = EXPECTED[name]
    chain = " → ".join(role for role, _ in expected)
    ps = load_profiles(name)
    assert ps.roles == tuple(role for role, _ in expected)
    for agent, (role, role_line) in zip(ps.agents, expected):
        team = TEAM_LINE.format(Role=role.capitalize(), N=len(expected), task=TASK[kind],
                                chain=chain)
        assert agent.system_prompt == team + "\n" + role_line


def test_single_agent_is_role_line_only():
    assert load_profiles("math/single").agents == (AgentProfile("solver", SOLVER),)
    assert load_profiles("code/single").agents == (AgentProfile("coder", CODER),)


@pytest.mark.parametrize("kind, final", [("math", MATH_FINAL), ("code", CODE_FINAL)])
@pytest.mark.parametrize("team, n", [("duo", 2), ("trio", 3), ("quad", 4)])
def test_anonymous_variants(kind, final, team, n):
    ps = load_profiles(f"{kind}/{team}-anonymous")
    assert ps.roles == tuple(f"agent_{k}" for k in range(1, n + 1))
    for k, agent in enumerate(ps.agents, 1):
        want = ANON.format(k=k, N=n) + (" " + final if k == n else "")
        assert agent.system_prompt == want
    validate(ps, n)


def test_load_from_yaml_and_json_files(tmp_path):
    doc = {"kind": "math", "answer_agent": "a",
           "agents": [{"role": "a", "system_prompt": "A."}, {"role": "b", "system_prompt": "B."}]}
    jpath = tmp_path / "team.json"
    jpath.write_text(json.dumps(doc))
    ps = load_profiles(str(jpath))
    assert ps.answer_agent == 0 and ps.roles == ("a", "b") and ps.name == str(jpath)
    ypath = tmp_path / "team.yaml"
    ypath.write_text("kind: code\nagents:\n  - role: x\n    system_prompt: |-\n      Line 1\n"
                     "      Line 2\n")
    ps = load_profiles(ypath)
    assert ps.agents == (AgentProfile("x", "Line 1\nLine 2"),) and ps.answer_agent == 0


def _set(*roles, prompts=None, answer=None, kind="math"):
    prompts = prompts or [f"Prompt of {r}." for r in roles]
    return ProfileSet(name="t", kind=kind, answer_agent=len(roles) - 1 if answer is None else answer,
                      agents=tuple(AgentProfile(r, p) for r, p in zip(roles, prompts)))


def test_validate_errors():
    with pytest.raises(ValueError, match=r"'math/duo' defines 2 agent\(s\) but the run has "
                                         r"num_agents=3"):
        validate(load_profiles("math/duo"), 3)
    with pytest.raises(ValueError, match=r"duplicate role name\(s\) \['a'\]"):
        validate(_set("a", "b", "a"))
    with pytest.raises(ValueError, match=r"answer_agent=2 is out of range for 2 agent\(s\) "
                                         r"\(valid: 0\.\.1\)"):
        validate(_set("a", "b", answer=2))
    with pytest.raises(ValueError, match="out of range"):
        validate(_set("a", "b", answer=-1))
    with pytest.raises(ValueError, match="answer_agent is undefined"):
        validate(dataclasses.replace(_set("a", "b"), answer_agent=None))
    with pytest.raises(ValueError, match=r"agents\[1\] \('b'\) has an empty system_prompt"):
        validate(_set("a", "b", prompts=["ok", "  \n"]))
    with pytest.raises(ValueError, match="kind must be one of"):
        validate(_set("a", kind="chess"))
    with pytest.raises(ValueError, match="defines no agents"):
        validate(_set())
    assert validate(load_profiles("code/quad"), 4).num_agents == 4


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown profile set 'math/pentad'; available: .*"
                                         r"code/duo.*math/quad-anonymous"):
        load_profiles("math/pentad")
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_profiles(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: math\nagents:\n  - role: a\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: agents\[0\] is missing 'system_prompt'"):
        load_profiles(str(bad))
    bad.write_text("kind: math\nagent:\n  - role: a\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['agent'\]"):
        load_profiles(str(bad))
    bad.write_text("kind: math\nanswer_agent: c\nagents:\n  - {role: a, system_prompt: x}\n")
    with pytest.raises(ValueError, match=r"answer_agent 'c' names no agent; roles: \['a'\]"):
        load_profiles(str(bad))
    bad.write_text("kind: math\nanswer_agent: null\nagents:\n  - {role: a, system_prompt: x}\n")
    with pytest.raises(ValueError, match="answer_agent is undefined"):
        load_profiles(str(bad))
    bad.write_text("kind: [unclosed\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_profiles(str(bad))
