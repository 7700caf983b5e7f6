"""Every preset under experiments/configs loads, validates and is internally consistent; config
errors name the offending key (or file). Nothing is run: these tests only build configs."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from pathlib import Path

import pytest

from marft_jax.config import PACKAGED_PRESETS, PRESET_DIR, Config, ConfigError, load_config, to_dict, to_yaml
from marft_jax.envs.profiles import load_profiles
from marft_jax.hub import is_repo_id
from marft_jax.models.registry import NAMED_MODELS

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(str(p.relative_to(PRESET_DIR).with_suffix("")) for p in PRESET_DIR.rglob("*.yaml"))
PAPER = [n for n in PRESETS if n.startswith("paper/")]
CPU_REPRO = [n for n in PRESETS if n.startswith("cpu_repro/")]
METHOD_TOKENS = {"marft-a": ("sequential", "action"), "marft-t": ("sequential", "token"),
                 "ippo": ("parallel", "action")}
TASK_TOKENS = {"math": "math", "gsm8k": "gsm8k", "aime": "aime", "humaneval": "humaneval"}


@functools.cache
def _generator():
    """experiments/make_paper_presets.py as a module (its tables)."""
    spec = importlib.util.spec_from_file_location("make_paper_presets", REPO / "experiments" / "make_paper_presets.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


@pytest.fixture(scope="module")
def configs() -> dict[str, Config]:
    from marft_jax.train.build import check_names    # the keys that name a registry's entries

    return {name: check_names(load_config(name)) for name in PRESETS}


def test_preset_inventory():
    assert "demo" in PRESETS
    assert sorted(CPU_REPRO) == ["cpu_repro/ippo", "cpu_repro/marft_a", "cpu_repro/marft_a_anonymous",
                                 "cpu_repro/marft_t", "cpu_repro/single", "cpu_repro/trio_ippo",
                                 "cpu_repro/trio_marft_a"]
    assert len(PAPER) >= 30


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_consistent(name, configs):
    cfg = configs[name]
    assert cfg.preset == name, "the `preset:` key must repeat the file's preset name"
    profile = load_profiles(cfg.team.profile)
    assert cfg.team.num_agents == profile.num_agents, cfg.team.profile
    if cfg.algo.level == "token":
        assert cfg.gamma == 1.0 and cfg.lam == 1.0
    is_ippo = "ippo" in name.split("/")[-1]
    assert (cfg.rollout.mode == "parallel") == is_ippo
    if is_ippo:
        assert cfg.team.num_agents >= 2
    m = cfg.model.name
    if name.startswith("paper/"):   # a Hub model at a pinned commit, a Hub dataset: nothing outside the repository
        assert is_repo_id(m) and re.fullmatch(r"[0-9a-f]{40}", cfg.model.revision or ""), (m, cfg.model.revision)
        assert cfg.task.path is None and cfg.task.eval_path is None
    else:
        assert m in NAMED_MODELS or m.endswith(".gguf") or is_repo_id(m), m
    assert profile.kind == ("code" if cfg.task.name in ("humaneval", "code_jsonl") else "math")


@pytest.mark.parametrize("name", PAPER)
def test_paper_name_matches_content(name, configs):
    """paper/<task>-<team>-<method>-<model>[-g2]: every token agrees with the keys."""
    cfg = configs[name]
    stem = name.removeprefix("paper/")
    g2 = stem.endswith("-g2")
    stem = stem.removesuffix("-g2")
    task, rest = stem.split("-", 1)
    assert TASK_TOKENS[task] == cfg.task.name
    method = next(t for t in METHOD_TOKENS if f"-{t}-" in f"-{rest}-")
    team, model = rest.split(f"-{method}-")
    assert cfg.team.profile.split("/", 1)[1] == team
    mode, level = METHOD_TOKENS[method]
    assert (cfg.rollout.mode, cfg.algo.level) == (mode, "token" if g2 else level)  # G2 (AReaL) is token level
    assert (cfg.model.name, cfg.model.revision) == _generator().MODELS[model][:2]
    assert cfg.train.eval_temperature == 0.6
    if g2:  # reference section 13, G2
        assert (cfg.optim.policy_lr, cfg.ppo.clip_eps, cfg.ppo.adv_norm, cfg.lora.rank) == (3e-5, 0.4, "none", 32)
        assert (cfg.algo.reward_bias, cfg.algo.reward_scale, cfg.algo.reward_clip) == (-0.5, 10.0, 20.0)
        assert cfg.rollout.max_new_tokens == 2048 and cfg.gamma == cfg.lam == 1.0
    else:  # the marft_jax defaults column
        assert (cfg.optim.policy_lr, cfg.optim.critic_lr) == (1e-6, 5e-5)
        assert (cfg.rollout.max_new_tokens, cfg.rollout.context_window, cfg.rollout.horizon) == (512, 2048, 3)
        assert (cfg.ppo.clip_eps, cfg.ppo.value_clip_eps, cfg.ppo.kl_stop) == (0.2, 0.2, 0.02)
        assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (8, 16.0, ["q_proj", "v_proj"])
    assert cfg.rollout.rows % (cfg.ppo.num_minibatches * cfg.ppo.micro_batches) == 0


@pytest.mark.parametrize("name, files, train, test", [
    ("paper/math-duo-marft-a-qwen2.5-3b", ("math_train.json", "math500.jsonl"), 7496, 500),
    ("paper/gsm8k-duo-marft-a-qwen2.5-3b", ("gsm8k_train.parquet", "gsm8k_test.json"), 7473, 1319),
    ("paper/aime-duo-marft-a-qwen2.5-3b", ("math_train.json", "aime2024.json"), 7496, 30),
])
def test_paper_presets_take_local_data_files(name, files, train, test, shared_data):
    """task.path / task.eval_path override a preset's Hub dataset with local files of the same sets."""
    from marft_jax.train.build import build_task

    cfg = load_config(name, [f"task.path={shared_data / files[0]}", f"task.eval_path={shared_data / files[1]}"])
    task = build_task(cfg)
    assert (task.split_size("train"), task.split_size("test")) == (train, test)
    assert cfg.train.eval_problems == test


def test_nothing_points_outside_the_repository():
    """No preset or package file names the shared data folder or a /models/ placeholder."""
    files = [p for root in (PRESET_DIR, REPO / "marft_jax") for p in root.rglob("*") if p.is_file()
             and p.suffix in (".yaml", ".py", ".cc", ".md", ".json")]
    bad = [str(p.relative_to(REPO)) for p in files if re.search(r"shared/data|/models/", p.read_text())]
    assert not bad, bad


def test_presets_cover_the_grid(configs):
    cfgs = list(configs.values())
    assert {c.team.num_agents for c in cfgs} >= {1, 2, 3, 4}
    methods = {(c.rollout.mode, c.algo.level) for c in cfgs if c.team.num_agents > 1}
    assert methods >= set(METHOD_TOKENS.values())
    assert any(c.team.profile.endswith("-anonymous") for c in cfgs)
    assert any(not c.team.profile.endswith("-anonymous") and c.team.num_agents > 1 for c in cfgs)
    sizes = {os.path.basename(c.model.name) for c in cfgs}
    assert {f"Qwen2.5-{s}-Instruct" for s in ("1.5B", "3B", "7B")} <= sizes
    assert {c.task.name for c in cfgs} >= {"arithmetic", "math", "gsm8k", "aime", "humaneval"}


def test_demo_is_cpu_sized(configs):
    cfg = configs["demo"]
    assert cfg.model.name == "smollm2-135m" and cfg.task.name == "arithmetic" and cfg.task.level == 1
    assert (cfg.team.profile, cfg.algo.level, cfg.rollout.mode) == ("math/duo-short", "action", "sequential")
    assert cfg.rollout.rows == 8 and cfg.rollout.max_new_tokens <= 128 and cfg.rollout.context_window == 512
    # ~15 minutes in all: two ~1-minute evaluations around the training budget
    assert cfg.train.time_budget_s <= 780 and cfg.train.eval_temperature == 0.0


def test_packaged_demo_matches():
    """marft_jax/presets/demo.yaml (found when the package is installed without the repo) is a copy."""
    assert (PACKAGED_PRESETS / "demo.yaml").read_text() == (PRESET_DIR / "demo.yaml").read_text()


def test_cpu_repro_presets_share_budgets(configs):
    method_keys = {"preset", "team.profile", "team.num_agents", "rollout.mode", "algo.level", "algo.gamma",
                   "algo.lam", "algo.ippo_own_weight", "rollout.agent_max_new_tokens"}

    def flat(cfg: Config) -> dict:
        return {f"{s}.{k}": v for s, sec in to_dict(cfg).items() if isinstance(sec, dict) for k, v in sec.items()
                if f"{s}.{k}" not in method_keys}

    ref = flat(configs["cpu_repro/marft_a"])
    for name in CPU_REPRO:
        assert flat(configs[name]) == ref, name
        assert configs[name].model.name == "smollm2-135m" and configs[name].task.name == "arithmetic"
        budget = configs[name].rollout.agent_max_new_tokens
        assert len(budget) == configs[name].team.num_agents and budget[-1] == (32 if len(budget) == 1 else 16)
    # the same episodes (env steps) per run whatever the team
    assert {(c.train.iterations, c.rollout.rows, c.rollout.horizon) for n, c in configs.items() if n in CPU_REPRO} \
        == {(30, 8, 1)}


def test_paper_presets_are_generated():
    expected = _generator().expected_files()
    assert sorted(expected) == sorted(PRESET_DIR.glob("paper/*.yaml"))
    stale = [p.name for p, text in expected.items() if p.read_text() != text]
    assert not stale, f"regenerate with `python experiments/make_paper_presets.py`: {stale}"


# ----------------------------------------------------------------------------- config errors


def test_override_applied_on_top_of_preset():
    cfg = load_config("demo", ["ppo.epochs=3", "lora.targets=[q_proj,k_proj,v_proj]", "train.time_budget_s=null"])
    assert cfg.ppo.epochs == 3
    assert cfg.lora.targets == ["q_proj", "k_proj", "v_proj"]
    assert cfg.train.time_budget_s is None
    assert cfg.optim.policy_lr == load_config("demo").optim.policy_lr  # the rest of the preset stays
    assert load_config("demo", ["ppo.epochs=3", "ppo.epochs=4"]).ppo.epochs == 4  # last one wins


def test_defaults_without_preset():
    assert dataclasses.asdict(load_config()) == dataclasses.asdict(Config())


def test_round_trip_through_yaml(tmp_path, configs):
    for name in ("demo", "paper/math-duo-marft-t-qwen2.5-3b-g2"):
        path = tmp_path / "dump.yaml"
        path.write_text(to_yaml(configs[name]))
        assert load_config(str(path)) == configs[name]


@pytest.mark.parametrize("override, key", [
    ("ppo.epochz=2", "ppo.epochz"),                   # unknown key
    ("ppo.epochs=abc", "ppo.epochs"),                 # wrong type
    ("rollout.rows=1.5", "rollout.rows"),             # wrong type
    ("optim.policy_lr=-1e-6", "optim.policy_lr"),     # negative lr
    ("optim.critic_lr=0", "optim.critic_lr"),
    ("ppo.clip_eps=0", "ppo.clip_eps"),               # clip <= 0
    ("ppo.clip_eps=-0.2", "ppo.clip_eps"),
    ("team.num_agents=0", "team.num_agents"),         # zero agents
    ("ppo.num_minibatches=3", "ppo.num_minibatches"),  # does not divide rollout.rows (8)
    ("algo.level=episode", "algo.level"),             # not a choice
    ("algo.gamma=1.5", "algo.gamma"),
    ("rollout.context_window=16", "rollout.context_window"),  # not above max_new_tokens
    ("rollout.agent_max_new_tokens=[16]", "rollout.agent_max_new_tokens"),        # one per agent (2)
    ("rollout.agent_max_new_tokens=[16,0]", "rollout.agent_max_new_tokens"),      # below 1
    ("rollout.agent_max_new_tokens=[16,4096]", "rollout.agent_max_new_tokens"),   # above max_new_tokens
    ("ppo.layer_update=vmap", "ppo.layer_update"),    # not a choice
])
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("demo", [override])


@pytest.mark.parametrize("override, match", [
    ("lora.targets=[qkv_proj]", r"lora\.targets: unknown module\(s\) \['qkv_proj'\]"),
    ("lora.targets=[]", r"lora\.targets must name at least one module"),
    ("team.graph=star", r"team\.graph='star': must be one of \['chain'"),
    ("team.layer_links=star", r"team\.layer_links='star': must be one of \['chain', 'layer'\]"),
    ("train.loggers=[jsonl,csv]", r"train\.loggers=.*unknown: \['csv'\]"),
])
def test_a_registry_name_is_checked_beside_its_registry_at_build(override, match):
    """config.py imports nothing of the package, so the keys that name a registry's entries are
    checked by ``check_names`` (the registries' own validators), which every entry point calls
    before any work; ``build_team`` (no model) is the cheapest of them."""
    from marft_jax.train.build import build_team, check_names

    cfg = load_config("demo", [override])
    for entry in (check_names, build_team):
        with pytest.raises(ConfigError, match=match):
            entry(cfg)


def test_concurrent_layers_outside_the_sequential_scan_name_both_keys():
    with pytest.raises(ConfigError, match=r"ppo\.layer_update.*ppo\.agent_schedule='interval'"):
        load_config("demo", ["ppo.layer_update=concurrent", "ppo.agent_schedule=interval"])


def test_unknown_key_in_yaml_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ppo:\n  epochs: 2\n  clip: 0.3\n")
    with pytest.raises(ConfigError, match=r"ppo\.clip"):
        load_config(str(path))


def test_unknown_section_names_it():
    with pytest.raises(ConfigError, match="trainer"):
        load_config(None, ["trainer.epochs=1"])


def test_yaml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("ppo:\n  epochs: [1, 2\noptim: {policy_lr: 1e-6\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(str(path))


def test_missing_file_and_unknown_preset():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/file.yaml")
    with pytest.raises(ConfigError, match="known presets:.*demo"):
        load_config("paper/no-such-preset")


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        load_config("demo", ["ppo.epochs"])


def test_configuration_doc_lists_every_key():
    """docs/configuration.md has a row for every Config key (add one when a field is added)."""
    doc = (REPO / "docs" / "configuration.md").read_text()

    def leaf_keys(prefix, node):
        if not isinstance(node, dict):
            return [prefix]
        return [k for name, sub in node.items() for k in leaf_keys(f"{prefix}.{name}", sub)]

    keys = [k for s, sec in to_dict(Config()).items() if isinstance(sec, dict) for k in leaf_keys(s, sec)]
    missing = [k for k in keys if f"| `{k}` |" not in doc]
    assert not missing, missing
    presets_named = [n for n in PRESETS if not n.startswith("paper/")]
    assert all(n.split("/")[0] in doc for n in presets_named)


def test_critic_lora_with_a_joint_history_graph_names_both_keys():
    from marft_jax.train.build import build_team

    with pytest.raises(ConfigError, match=r"ppo\.critic_lora.*math/mixture-short.*team\.graph"):
        build_team(load_config("demo-mixture", ["ppo.critic_lora=true"]))
    assert build_team(load_config("demo", ["ppo.critic_lora=true"])).topology.is_chain


def test_reference_semantics_with_the_independent_graph_names_both_keys():
    """G1's chained masks have no meaning on per-agent links (the backup refuses them too)."""
    from marft_jax.train.build import build_team

    for over in (["rollout.mode=parallel"], ["team.graph=independent"]):
        with pytest.raises(ConfigError, match=r"algo\.reference_semantics.*independent graph.*rollout\.mode"):
            build_team(load_config("demo", over + ["algo.reference_semantics=true"]))
