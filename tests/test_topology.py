"""The team graph: layers, answerers, link tables (hand-built oracles) and the graph errors."""

import numpy as np
import pytest

from marft_jax.rl import topology as topo

ROLES3 = ("proposer_a", "proposer_b", "aggregator")


def test_named_graphs_have_the_expected_layers_and_answerers():
    chain = topo.named("chain", ROLES3)
    assert chain.layers == ((0,), (1,), (2,)) and chain.answer_agents == (2,) and chain.is_chain
    ind = topo.named("independent", ROLES3)
    assert ind.layers == ((0, 1, 2),) and ind.answer_agents == (0, 1, 2) and ind.independent
    mix = topo.named("mixture", ROLES3)
    assert mix.layers == ((0, 1), (2,)) and mix.parents == ((), (), (0, 1)) and mix.answer_agents == (2,)
    assert not mix.is_chain and mix.critic_reads_all_earlier("chain") and not mix.critic_reads_all_earlier("layer")
    deb = topo.named("debate", ROLES3[:2])
    assert deb.layers == ((0, 1),) and deb.answer_agents == (0, 1) and not deb.independent
    assert "layer 1: aggregator <- proposer_a, proposer_b" in mix.describe()


def test_chain_links_are_the_flat_execution_order_recurrence():
    for graph in ("chain", "mixture", "debate"):
        t = topo.named(graph, ROLES3).links(2, "chain")
        assert t.kind == "chain"
        np.testing.assert_array_equal(t.succ, [[1, 2, 3], [4, 5, 6]])
        np.testing.assert_array_equal(t.succ_crosses, [[False, False, True]] * 2)
    ind = topo.named("independent", ROLES3).links(2)
    assert ind.kind == "per_agent"
    np.testing.assert_array_equal(ind.succ, [[3, 4, 5], [6, 6, 6]])


def _layer_oracle(layers, num_agents, num_steps):
    """A plain loop over the definition: a response links to the first agent of the next layer
    (or of the next step's first layer, or the end); an empty response forwards to its next
    sibling in the layer, the last sibling to the layer's successor."""
    N, S, end = num_agents, num_steps, num_agents * num_steps
    succ, skip = {}, {}
    for s in range(S):
        for k, layer in enumerate(layers):
            if k + 1 < len(layers):
                nxt = (s * N + layers[k + 1][0], False)
            elif s + 1 < S:
                nxt = ((s + 1) * N + layers[0][0], True)
            else:
                nxt = (end, True)
            for pos, i in enumerate(layer):
                succ[s, i] = nxt
                skip[s, i] = (s * N + layer[pos + 1], False) if pos + 1 < len(layer) else nxt
    return succ, skip


@pytest.mark.parametrize("graph,roles,steps,expected_succ,expected_skip", [
    # mixture: two proposers share the aggregator as successor; an empty proposer_a forwards to
    # proposer_b; the aggregator links to the next step's first proposer (crossing the step).
    ("mixture", ROLES3, 2, [[2, 2, 3], [5, 5, 6]], [[1, 2, 3], [4, 5, 6]]),
    # debate, 2 debaters, 3 rounds: both link to the next round's first debater.
    ("debate", ("pro", "con"), 3, [[2, 2], [4, 4], [6, 6]], [[1, 2], [3, 4], [5, 6]]),
])
def test_layer_links_match_hand_built_tables_and_the_loop_oracle(graph, roles, steps, expected_succ,
                                                                 expected_skip):
    t = topo.named(graph, roles)
    table = t.links(steps, "layer")
    assert table.kind == "table"
    np.testing.assert_array_equal(table.succ, expected_succ)
    np.testing.assert_array_equal(table.skip, expected_skip)
    succ, skip = _layer_oracle(t.layers, t.num_agents, steps)
    for (s, i), (c, crosses) in succ.items():
        assert (table.succ[s, i], table.succ_crosses[s, i]) == (c, crosses)
    for (s, i), (c, crosses) in skip.items():
        assert (table.skip[s, i], table.skip_crosses[s, i]) == (c, crosses)
    receivers = t.reward_receivers("layer")
    if len(t.layers[-1]) == 1:   # one agent at the end: the chained placement (last valid point)
        assert receivers is None
    else:
        np.testing.assert_array_equal(receivers, np.isin(np.arange(t.num_agents), t.layers[-1]))


def test_explicit_parents_build_the_same_graph_as_the_named_one():
    t = topo.from_parents({"aggregator": ["proposer_b", "proposer_a"]}, ROLES3, ["aggregator"])
    assert t.parents == topo.named("mixture", ROLES3).parents and t.layers == ((0, 1), (2,))
    # a deeper DAG: a critic reads the solver, the final judge reads everyone
    t = topo.from_parents({"solver": ["planner"], "checker": ["solver"], "judge": ["planner", "checker"]},
                          ("planner", "solver", "checker", "judge"), ["judge"])
    assert t.layers == ((0,), (1,), (2,), (3,)) and not t.is_chain


@pytest.mark.parametrize("call,needles", [
    (lambda: topo.from_parents({"a": ["b"], "b": ["a"]}, ("a", "b"), ["b"]), ["cycle", "a", "b"]),
    (lambda: topo.from_parents({"b": ["ghost"]}, ("a", "b"), ["b"]), ["unknown", "ghost"]),
    (lambda: topo.from_parents({"c": ["a"]}, ("a", "b", "c"), ["c"]), ["'b'", "read by no role"]),
    (lambda: topo.from_parents({}, ("a", "b"), ["zed"]), ["answering", "zed"]),
    (lambda: topo.from_parents({"a": ["b"]}, ("a", "b"), ["a"]), ["'a'", "'b'", "execution order"]),
    (lambda: topo.named("mixture", ("a", "b")), ["mixture", "at least 3"]),
    (lambda: topo.named("star", ("a", "b")), ["team.graph", "star"]),
    (lambda: topo.resolve("chain", roles=("a", "b"), answer_agent=1, num_agents=3), ["team.num_agents=3", "'a'"]),
    (lambda: topo.resolve("mixture", roles=ROLES3, answer_agent=2, mode="parallel"), ["rollout.mode", "mixture"]),
])
def test_graph_errors_name_the_roles_involved(call, needles):
    with pytest.raises(topo.TopologyError) as err:
        call()
    for needle in needles:
        assert needle in str(err.value)


def test_resolve_defaults_follow_the_rollout_mode_and_the_profile():
    assert topo.resolve(None, roles=("a", "b"), answer_agent=1).is_chain
    assert topo.resolve(None, roles=("a", "b"), answer_agent=1, mode="parallel").independent
    t = topo.resolve(None, roles=ROLES3, answer_agent=2, profile_parents={"aggregator": ["proposer_a", "proposer_b"]})
    assert t.layers == ((0, 1), (2,))
    with pytest.raises(topo.TopologyError, match="conflicts"):
        topo.resolve("chain", roles=ROLES3, answer_agent=2, profile_parents={"aggregator": ["proposer_a"]})


@pytest.mark.parametrize("graph,roles,joint,boot,reported", [
    # chain: every critic already reads all earlier agents; agent 0 bootstraps; the answerer reports
    ("chain", ROLES3, (), (0,), 2),
    # independent learners: own contexts, one bootstrap per agent, the team's answerer reports
    ("independent", ROLES3, (), (0, 1, 2), 1),
    # mixture: proposer_b's joint-history critic reads proposer_a; the aggregator reads both anyway
    ("mixture", ROLES3, (1,), (0,), 2),
    # debate: the second debater's critic reads the first's output
    ("debate", ("pro", "con"), (1,), (0,), 1),
])
def test_joint_reads_bootstrap_agents_and_reported_answerer(graph, roles, joint, boot, reported):
    t = topo.named(graph, roles)
    assert [t.joint_reads(i) for i in range(len(roles))] == [tuple(range(i)) for i in range(len(roles))]
    assert t.joint_critic_agents("chain") == joint and t.joint_critic_agents("layer") == ()
    assert t.bootstrap_agents == boot
    if t.independent:
        with pytest.raises(ValueError, match="bootstrap_agents"):
            t.bootstrap_agent
    else:
        assert t.bootstrap_agent == 0 == t.layers[0][0]
    assert t.reported_answerer(1) == reported


def test_joint_critic_agents_of_a_profile_graph_skip_agents_that_read_every_earlier_one():
    t = topo.from_parents({"c": ["a", "b"], "d": ["b"]}, ("a", "b", "c", "d"), ["c", "d"])
    assert t.layers == ((0, 1), (2, 3)) and t.joint_critic_agents("chain") == (1, 3)
    assert t.bootstrap_agents == (0,) and t.bootstrap_agent == 0 and t.reported_answerer(0) == 3
