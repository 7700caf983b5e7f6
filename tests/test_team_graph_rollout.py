"""The rollout follows the team graph: one sampler call per layer, contexts with the parents'
outputs only, answerers scored (mean), and the chain / independent graphs equal to the
sequential / parallel modes. A fake sampler and a character tokenizer: no model."""

from __future__ import annotations

import dataclasses
import textwrap

import jax
import numpy as np
import pytest

from marft_jax.config import AlgoConfig, RolloutConfig
from marft_jax.envs.profiles import load_profiles
from marft_jax.envs.task import Problem, Score
from marft_jax.rl import topology as topo
from marft_jax.rl.rollout import Generation, Team, rollout
from tests.char_tokenizer import CharTokenizer


class FakeSampler:
    """Agent ``a`` answers ``A{a}k{draw}`` where draw is a function of the key (so the key each
    call gets matters) and of the row's place in the call."""

    def __init__(self):
        self.calls: list[tuple[list[int], list[str]]] = []

    def __call__(self, prompts, agents, max_new, key):
        tok = CharTokenizer()
        draws = np.asarray(jax.random.randint(key, (len(prompts),), 0, 10))
        texts = [f"A{a}k{d}" for a, d in zip(agents.tolist(), draws.tolist())]
        self.calls.append((agents.tolist(), [tok.decode(p) for p in prompts]))
        K = max(max_new, 1)
        tokens = np.zeros((len(prompts), K), np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for j, t in enumerate(texts):
            ids = tok.encode_text(t)[:K]
            tokens[j, :len(ids)] = ids
            lengths[j] = len(ids)
        logp = -np.ones((len(prompts), K), np.float32)
        return Generation(tokens, lengths, logp, logp.copy(), np.zeros_like(logp))


def score_first_agent_right(transcripts):
    """Reward 1 for agent 0's answers, 0 for everybody else's."""
    return [Score(float(t.answer_agent == 0), {"who": t.answer_agent}) for t in transcripts]


PROBLEMS = [Problem(uid=f"p{b}", text=f"task {b}") for b in range(3)]


def _play(team, cfg, generate=None):
    generate = generate or FakeSampler()
    traj, texts = rollout(PROBLEMS, team=team, tokenizer=CharTokenizer(), generate=generate,
                          score=score_first_agent_right, cfg=cfg, key=jax.random.key(3))
    return traj, texts, generate


def _team(roles, graph=None, answer=None):
    roles = tuple(roles)
    return Team(roles=roles, system_prompts=tuple(f"you are {r}" for r in roles),
                answer_agent=len(roles) - 1 if answer is None else answer, topology=graph)


def _assert_same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None:
            assert x is None and y is None, f.name
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f.name)


def test_mixture_makes_one_call_per_layer_and_the_aggregator_reads_both_proposers():
    roles = ("proposer_a", "proposer_b", "aggregator")
    traj, texts, gen = _play(_team(roles, topo.named("mixture", roles)), RolloutConfig(max_new_tokens=8))
    assert texts.sampler_calls == 2
    (agents0, prompts0), (agents1, prompts1) = gen.calls
    assert agents0 == [0, 1] * 3 and agents1 == [2] * 3
    assert all("[proposer" not in p for p in prompts0)            # proposers read nobody
    for b, p in enumerate(prompts1):
        assert f"[proposer_a]: {texts.outputs[0][b][0]}" in p and f"[proposer_b]: {texts.outputs[0][b][1]}" in p
    np.testing.assert_array_equal(traj.score[0], 0.0)             # the aggregator (agent 2) answers
    np.testing.assert_array_equal(traj.agent_score[0], 0.0)


def test_debate_rounds_read_the_round_before_and_score_the_mean_of_the_debaters():
    roles = ("pro", "con")
    cfg = RolloutConfig(max_new_tokens=8, horizon=2)
    traj, texts, gen = _play(_team(roles, topo.named("debate", roles)), cfg)
    assert texts.sampler_calls == 1 and len(gen.calls) == 2          # one layer per round
    for b, p in enumerate(gen.calls[1][1][0::2]):                    # round 2, debater pro
        assert f"[pro]: {texts.outputs[0][b][0]}" in p and f"[con]: {texts.outputs[0][b][1]}" in p
    assert all("[con]" not in p for p in gen.calls[0][1])
    np.testing.assert_allclose(traj.score[:, :], 0.5)                # mean of 1 (pro) and 0 (con)
    np.testing.assert_allclose(traj.agent_score, 0.5)                # a cooperative team: shared
    assert traj.step_mask.all() and traj.terminal[1].all()


def test_chain_graph_equals_the_sequential_mode_and_calls_once_per_agent():
    roles = ("planner", "critic", "solver")
    cfg = RolloutConfig(max_new_tokens=8, horizon=2, max_steps=2)
    ref, ref_texts, ref_gen = _play(_team(roles, answer=0), cfg)
    got, got_texts, got_gen = _play(_team(roles, topo.named("chain", roles, 0), answer=0), cfg)
    _assert_same(ref, got)
    assert ref_texts.outputs == got_texts.outputs and got_texts.sampler_calls == 3
    assert [c[0] for c in got_gen.calls[:3]] == [[0] * 3, [1] * 3, [2] * 3]
    for b, p in enumerate(got_gen.calls[2][1]):                      # the solver reads both before it
        assert f"[planner]: {got_texts.outputs[0][b][0]}" in p and f"[critic]: {got_texts.outputs[0][b][1]}" in p
    # agent 0 answers and is right: every episode ends after one step
    np.testing.assert_array_equal(got.score[0], 1.0)
    assert not got.step_mask[1].any()


def test_independent_graph_equals_the_parallel_mode():
    roles = ("a", "b")
    cfg = RolloutConfig(max_new_tokens=8, horizon=3, max_steps=2)
    ref, ref_texts, _ = _play(_team(roles), dataclasses.replace(cfg, mode="parallel"))
    got, got_texts, gen = _play(_team(roles, topo.named("independent", roles)), cfg)
    _assert_same(ref, got)
    assert ref_texts.outputs == got_texts.outputs and ref_texts.infos == got_texts.infos
    np.testing.assert_array_equal(got.agent_score[0], [[1.0, 0.0]] * 3)
    assert got.truncated[1].all() and got.boot_ctx_valid.any(-1).all()   # both agents bootstrap


def test_profile_parents_define_the_graph_and_bad_graphs_name_the_file(tmp_path):
    good = tmp_path / "mix.yaml"
    good.write_text(textwrap.dedent("""\
        kind: math
        answer_agent: judge
        agents:
        - {role: x, system_prompt: "p"}
        - {role: y, system_prompt: "p"}
        - {role: judge, system_prompt: "p", parents: [x, y]}
        """))
    prof = load_profiles(good)
    t = topo.resolve(None, roles=prof.roles, answer_agent=prof.answer_agent, profile_parents=prof.parents)
    assert t.layers == ((0, 1), (2,)) and t.answer_agents == (2,)
    assert load_profiles("math/mixture-short").parents == {"aggregator": ("proposer_a", "proposer_b")}
    bad = tmp_path / "cycle.yaml"
    bad.write_text(good.read_text().replace('{role: x, system_prompt: "p"}',
                                            '{role: x, system_prompt: "p", parents: [judge]}'))
    from marft_jax.config import load_config
    from marft_jax.train.build import build_team

    def team_of(path):        # the graph is checked where the run's team is built (envs/ never imports rl/)
        return build_team(load_config(None, [f"team.profile={path}", "team.num_agents=3"]))

    assert team_of(good).topology.layers == ((0, 1), (2,))
    with pytest.raises(ValueError) as err:
        team_of(bad)
    assert "cycle.yaml" in str(err.value) and "judge" in str(err.value) and "x" in str(err.value)
    idle = tmp_path / "idle.yaml"
    idle.write_text(good.read_text().replace("parents: [x, y]", "parents: [x]"))
    with pytest.raises(ValueError, match=r"\['y'\].*read by no role"):
        team_of(idle)


def test_the_critic_reads_the_joint_history_where_the_policy_reads_its_parents_only():
    roles = ("proposer_a", "proposer_b", "aggregator")
    traj, texts, _ = _play(_team(roles, topo.named("mixture", roles)), RolloutConfig(max_new_tokens=8))
    tok = CharTokenizer()
    for b in range(len(PROBLEMS)):
        own = tok.decode(np.asarray(traj.ctx_tokens[0, b, 1])[np.asarray(traj.ctx_valid[0, b, 1])])
        joint = tok.decode(np.asarray(traj.critic_ctx_tokens[0, b, 1])[np.asarray(traj.critic_ctx_valid[0, b, 1])])
        assert "[proposer_a]" not in own
        assert f"[proposer_a]: {texts.outputs[0][b][0]}" in joint
        for i in (0, 2):        # agents whose parents are all the agents before them: the same state
            np.testing.assert_array_equal(traj.critic_ctx_tokens[0, b, i], traj.ctx_tokens[0, b, i])
            np.testing.assert_array_equal(traj.critic_ctx_valid[0, b, i], traj.ctx_valid[0, b, i])
    for name in ("chain", "independent"):
        roles2 = ("a", "b")
        t2, _, _ = _play(_team(roles2, topo.named(name, roles2)), RolloutConfig(max_new_tokens=8))
        assert t2.critic_ctx_tokens is None and t2.critic_ctx_valid is None


def test_layer_links_keep_each_agents_own_critic_context_and_give_the_backup_the_table():
    """``team.layer_links=layer``: no joint critic contexts (the policy trajectory unchanged),
    and the prepare step's backup program places the reward and backs up along the layer table."""
    import jax.numpy as jnp

    from marft_jax.rl import backups, layout, rewards
    from marft_jax.rl.advantages import AdvantageConfig
    from marft_jax.rl.advantages import advantages as _advantages

    roles = ("proposer_a", "proposer_b", "aggregator")
    graph = topo.named("mixture", roles)
    cfg = RolloutConfig(max_new_tokens=8, horizon=2)
    chained, _, _ = _play(_team(roles, graph), cfg)
    layered, _, _ = _play(dataclasses.replace(_team(roles, graph), layer_links="layer"), cfg)
    assert chained.critic_ctx_tokens is not None
    assert layered.critic_ctx_tokens is None and layered.critic_ctx_valid is None
    for f in dataclasses.fields(layered):
        if not f.name.startswith("critic_ctx"):
            x, y = getattr(chained, f.name), getattr(layered, f.name)
            assert (x is None and y is None) or np.array_equal(np.asarray(x), np.asarray(y)), f.name
    with pytest.raises(ValueError, match="team.layer_links"):
        dataclasses.replace(_team(roles, graph), layer_links="star")

    t = layered
    S, B, N, _, K = t.shape
    value = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (S, B, N, K)), jnp.float32)
    v_boot = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (B, N)), jnp.float32)
    arrays = [jnp.asarray(x) for x in (t.act_valid, t.step_mask, t.score, t.agent_score, t.terminal, t.truncated)]
    out = {}
    for links in ("chain", "layer"):
        acfg = AdvantageConfig(algo=AlgoConfig(level="token", gamma=0.9, lam=0.8, reward_bias=1.0), topology=graph,
                               layer_links=links)
        out[links] = _advantages(value, arrays[0], *arrays[1:], v_boot, acfg=acfg)
    table = graph.links(S, "layer")
    dp = layout.token_decision_mask(arrays[0], arrays[1])
    r = rewards.transform_reward(rewards.final_step_reward(arrays[2], arrays[1]), bias=1.0)
    placed = rewards.place_reward(r, dp, arrays[1], links=table)
    want = backups.marft_gae(placed, jnp.where(dp, value, 0.0), dp, arrays[1], arrays[4], arrays[5], v_boot[:, 0],
                             gamma=0.9, lam=0.8, links=table)
    _, _, got_placed, got_adv, got_ret = out["layer"]
    np.testing.assert_array_equal(np.asarray(got_placed), np.asarray(placed))
    np.testing.assert_allclose(np.asarray(got_adv), np.asarray(want.advantages), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_ret), np.asarray(want.returns), atol=1e-6)
    # proposer_a links to the aggregator (layer), not to proposer_b (chain): another advantage
    adv_chain = np.asarray(out["chain"][3])
    assert not np.allclose(adv_chain[:, :, 0], np.asarray(got_adv)[:, :, 0], atol=1e-3)
