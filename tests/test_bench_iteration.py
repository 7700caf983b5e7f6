"""Smoke test of ``bench iteration``: the tiny workload end to end, both sides, in subprocesses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
STAGES = ("rollout", "values_logprobs_backup", "update")
STAGE_KEYS = {"s", "valid_tokens", "computed_tokens", "flops_per_s", "roofline_fraction"}


def test_bench_iteration_tiny_end_to_end():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "marft_jax.bench.iteration", "--workload", "tiny", "--no-eos",
           "--horizon", "1", "--roofline-n", "128", "--torch-threads", "1", "--bandwidth-mib", "16",
           "--concurrent-sides"]                                       # timings are not checked here
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])        # the last stdout line

    assert report["workload"] == "tiny" and report["no_eos"] is True
    assert {"command", "commit", "machine", "ratio_per_env_step", "env_steps"} <= set(report)
    assert report["machine"]["logical_cores"] >= 1
    assert report["env_steps"] == {"ours": 2, "reference": 2}        # 2 rows x horizon 1
    assert math.isfinite(report["ratio_per_env_step"]) and report["ratio_per_env_step"] > 0
    for side in ("ours", "reference"):
        r = report[side]
        assert r["peak_rss_bytes"] > 50 * 2 ** 20, side               # at least the interpreter + model
        assert r["s_per_env_step"] > 0 and r["env_steps"] == 2
        assert set(r["stages"]) == set(STAGES), side
        for name, st in r["stages"].items():
            assert STAGE_KEYS <= set(st), (side, name)
            assert st["s"] > 0 and st["flops_per_s"] > 0, (side, name)
            assert 0 < st["roofline_fraction"] < 5, (side, name)       # a loose sanity bound
            assert st["computed_tokens"] >= st["valid_tokens"] > 0, (side, name, st)
        # the iteration is the sum of its stages (ours adds a little host bookkeeping)
        assert sum(st["s"] for st in r["stages"].values()) <= r["s"] * 1.01
    # --no-eos: every response runs to the 8-token budget on both sides
    for side in ("ours", "reference"):
        assert set(report[side]["completions_mean_length"].values()) == {8.0}, side
    # the rollout does the same valid work on both sides up to the sampled texts (same prompts)
    o, r = (report[s]["stages"]["rollout"]["valid_tokens"] for s in ("ours", "reference"))
    assert abs(o - r) <= 0.2 * max(o, r)
    ours = report["ours"]
    assert ours["warmup_s"] and ours["warmup_s"][0] > 0
    assert ours["backend_compile_s"]["measured"] < 0.5 * ours["backend_compile_s"]["warmup"][0] + 1e-9
    # the floor: each side's minimal work at this run's roofline and read bandwidth
    fl = report["floor"]
    assert fl["roofline_flops_per_s"] > 0 and fl["read_bytes_per_s"] > 0
    floor_stages = ("prefill", "decode", "critic_features", "update")
    for side in ("ours", "reference"):
        r, f = report[side], fl[side]
        assert f == r["floor_s"] and set(floor_stages) | {"rollout", "iteration"} <= set(f), side
        for k in floor_stages:
            w = r["floor_work"][k]
            assert f[k] == pytest.approx(max(w["flops"] / fl["roofline_flops_per_s"],
                                             w["bytes"] / fl["read_bytes_per_s"])) and f[k] > 0, (side, k)
        assert f["iteration"] == pytest.approx(sum(f[k] for k in floor_stages))
        over = report[f"{side}_over_floor"]
        assert over == r["over_floor"] and over["iteration"] == pytest.approx(r["s"] / f["iteration"])
        assert {"iteration", "rollout", "critic_features", "update"} <= set(over), side
        assert all(v > 0.5 for v in over.values()), (side, over)     # nothing runs far below its floor
        assert r["stages"]["update"]["floor_s"] == f["update"]
    assert {"prefill", "decode"} <= set(report["ours_over_floor"])
    # no EOS: 2 calls (one per agent) x 2 rows x 7 decode steps (the first token comes from the prefill)
    assert report["ours"]["floor_work"]["decode"]["tokens"] == 2 * 2 * 7
    # the reference's rollout was also timed without OMP_WAIT_POLICY=PASSIVE; the faster is kept
    ref = report["reference"]
    assert set(ref["rollout_s_by_omp_wait_policy"]) == {"PASSIVE", "unset"}
    assert ref["stages"]["rollout"]["s"] == min(ref["rollout_s_by_omp_wait_policy"].values())
    # per-agent padding: one context length per agent in each update minibatch
    assert all(len(u["L"]) == 2 for u in ref["update_shapes"])


def test_workload_problems_filtered_by_the_reasoner_context_length():
    """The ``long`` workload keeps the problems whose agent-0 context is in its token range
    (counted with the run's own prompt builder), in the task's seeded order."""
    import types

    from marft_jax.bench import iteration as bench
    from marft_jax.config import RolloutConfig
    from marft_jax.envs.task import Problem
    from marft_jax.rl.rollout import Team

    class Chars:               # one token per character
        def encode_text(self, text):
            return list(text)

    problems = [Problem(f"p{i}", "x" * n) for i, n in enumerate((5, 200, 40, 300, 60))]
    run = types.SimpleNamespace(
        learner=types.SimpleNamespace(rollout_cfg=RolloutConfig(prompt_format="g1_raw")),
        team=Team(roles=("reasoner", "actor"), system_prompts=("S", "S"), answer_agent=1), tokenizer=Chars(),
        task=types.SimpleNamespace(problems=lambda split, seed: iter(problems)),
        config=types.SimpleNamespace(train=types.SimpleNamespace(seed=0)))
    from marft_jax.rl import rollout as rollout_lib

    overhead = len(rollout_lib._context(run.team, Problem("e", ""), 0, [], {}, run.learner.rollout_cfg, run.tokenizer))
    wl = bench.Workload("long", (), agent0_context=(overhead + 30, overhead + 250))
    assert [p.uid for p in bench.select_problems(run, wl, 3)] == ["p1", "p2", "p4"]
    with pytest.raises(ValueError, match="only 3 problems fit"):
        bench.select_problems(run, wl, 4)
