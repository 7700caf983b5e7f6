"""Write the paper-style presets under ``experiments/configs/paper/`` from one table.

Each preset is ``paper/<task>-<team>-<method>-<model>[-g2].yaml``:

* task: ``math`` (MATH train, MATH-500 eval), ``gsm8k``, ``aime`` (MATH train, AIME 2024 eval),
  ``humaneval`` (its 164 problems serve for both); each reads the Hub dataset pinned in
  ``marft_jax/data/hub_datasets.py`` (``task.path`` / ``task.eval_path`` override it);
* team: ``single``, ``duo``, ``trio``, ``quad`` (named roles) or ``<team>-anonymous``;
* method: ``marft-a`` (action level), ``marft-t`` (token level, gamma = lam = 1), ``ippo``
  (independent PPO: ``rollout.mode: parallel``);
* model: ``qwen2.5-1.5b`` / ``-3b`` / ``-7b`` (Instruct) or ``qwen3-1.7b`` (post-trained): a Hub id
  at a pinned commit, fetched into the Hugging Face cache on first use;
* ``-g2``: the AReaL-based MARFT (G2) hyper-parameters of reference §13 instead of the
  ``marft_jax`` defaults column (token level with gamma = lam = 1, for ``marft-t`` and ``ippo``).

The grid is representative, not the full product (see ``GRID``). The files are generated so
that they stay consistent; edit this table and rerun::

    python experiments/make_paper_presets.py           # rewrite the files
    python experiments/make_paper_presets.py --check   # exit 1 if a file is out of date

``tests/test_presets.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from marft_jax.data.hub_datasets import HUB_TASKS

OUT_DIR = Path(__file__).resolve().parent / "configs" / "paper"

MODELS = {  # name token -> (Hub id, commit, micro-batches for 32 rows, remat)
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", "989aa7980e4cf806f80c7fef2b1adb7bc71aa306", 2, False),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B-Instruct", "aa8e72537993ba99e69dfaafa59ed015b17504d1", 4, False),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", "a09a35458c702b33eeacc393d103063234e8bc28", 8, True),
    # hidden 2048 like the 3B (28 layers instead of 36): the 3B's micro-batches
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e", 4, False),
}

# name token -> (task section, profile kind, eval problems). task.path null: the pinned Hub
# dataset of marft_jax/data/hub_datasets.py. G2 trains on its own AIME-style set; without one,
# the aime task trains on MATH and evaluates on AIME 2024. A stdio code set (task.name
# code_jsonl) has no pinned Hub dataset, so no preset here names one.
TASKS = {
    "math": ({"name": "math", "path": None, "eval_path": None}, "math", 500),
    "gsm8k": ({"name": "gsm8k", "path": None, "eval_path": None}, "math", 1319),
    "aime": ({"name": "aime", "path": None, "eval_path": None}, "math", 30),
    "humaneval": ({"name": "humaneval", "path": None, "code_reward": "fraction"}, "code", 164),
}

TEAMS = {"single": 1, "duo": 2, "trio": 3, "quad": 4,
         "duo-anonymous": 2, "trio-anonymous": 3, "quad-anonymous": 4}

METHODS = {  # name token -> (rollout.mode, algo.level, gamma, lam)
    "marft-a": ("sequential", "action", 0.99, 0.95),
    "marft-t": ("sequential", "token", 1.0, 1.0),
    "ippo": ("parallel", "action", 0.99, 0.95),
}

# (task, team, method, model, g2)
GRID: list[tuple[str, str, str, str, bool]] = (
    # MATH: every team x method on 3B (no IPPO for one agent: it is the same run) ...
    [("math", team, m, "qwen2.5-3b", False) for team in ("duo", "trio", "quad") for m in METHODS]
    + [("math", "single", m, "qwen2.5-3b", False) for m in ("marft-a", "marft-t")]
    # ... model size, anonymous roles, G2 hyper-parameters
    + [("math", "duo", "marft-a", size, False) for size in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen3-1.7b")]
    + [("math", team, "marft-a", "qwen2.5-3b", False) for team in ("duo-anonymous", "trio-anonymous")]
    + [("math", "duo", "marft-t", "qwen2.5-3b", True), ("math", "duo", "ippo", "qwen2.5-3b", True),
       ("math", "duo", "marft-t", "qwen2.5-7b", True)]
    # GSM8K
    + [("gsm8k", "duo", m, "qwen2.5-3b", False) for m in METHODS]
    + [("gsm8k", "single", "marft-a", "qwen2.5-3b", False), ("gsm8k", "trio", "marft-a", "qwen2.5-3b", False),
       ("gsm8k", "duo", "marft-a", "qwen2.5-7b", False), ("gsm8k", "duo", "marft-t", "qwen2.5-3b", True)]
    # AIME 2024
    + [("aime", "duo", m, "qwen2.5-3b", False) for m in METHODS]
    + [("aime", "single", "marft-a", "qwen2.5-3b", False), ("aime", "duo", "marft-t", "qwen2.5-7b", True)]
    # Code: HumanEval
    + [("humaneval", "duo", m, "qwen2.5-3b", False) for m in METHODS]
    + [("humaneval", team, "marft-a", "qwen2.5-3b", False)
       for team in ("single", "trio", "quad", "duo-anonymous", "quad-anonymous")]
)

G2_ROWS = {"math": 64, "aime": 128, "gsm8k": 128}  # G2 batch (GSM8K 7B: 256)


def preset_name(task: str, team: str, method: str, model: str, g2: bool) -> str:
    return f"paper/{task}-{team}-{method}-{model}" + ("-g2" if g2 else "")


def build(task: str, team: str, method: str, model: str, g2: bool) -> dict:
    """The YAML document of one preset (every key also exists in ``marft_jax.config.Config``)."""
    model_id, revision, micro, remat = MODELS[model]
    task_section, kind, eval_problems = TASKS[task]
    mode, level, gamma, lam = METHODS[method]
    doc = {
        "preset": preset_name(task, team, method, model, g2),
        "model": {"name": model_id, "revision": revision, "dtype": "auto", "remat": remat},
        "lora": {"rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj"]},
        "task": dict(task_section),
        "team": {"profile": f"{kind}/{team}", "num_agents": TEAMS[team]},
        "rollout": {"mode": mode, "rows": 32, "horizon": 3, "max_new_tokens": 512, "context_window": 2048,
                    "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "algo": {"level": level, "gamma": gamma, "lam": lam, "reward_to": "last",
                 "reward_bias": 0.0, "reward_scale": 1.0, "reward_clip": None},
        "ppo": {"epochs": 1, "num_minibatches": 1, "micro_batches": micro, "clip_eps": 0.2, "value_clip_eps": 0.2,
                "value_loss": "huber", "huber_delta": 10.0, "ent_coef": 0.01, "vf_coef": 1.0,
                "adv_norm": "minibatch", "kl_stop": 0.02, "max_grad_norm": 0.5, "critic_max_grad_norm": 0.5,
                "logprob_norm": "sum", "agent_schedule": "sequential"},
        "optim": {"policy_lr": 1.0e-6, "critic_lr": 5.0e-5, "eps": 1.0e-5, "weight_decay": 0.0,
                  "schedule": "constant"},
        "train": {"iterations": 400, "seed": 0, "out_dir": "runs", "eval_every": 50,
                  "eval_problems": eval_problems, "eval_temperature": 0.6, "save_every": 25, "keep_last": 3,
                  "scoring_workers": 8},
    }
    if method == "ippo":
        doc["algo"]["ippo_own_weight"] = 0.5
    if g2:
        rows = 256 if (task == "gsm8k" and model == "qwen2.5-7b") else G2_ROWS[task]
        doc["lora"].update(rank=32, alpha=16.0)
        doc["task"]["max_prompt_tokens"] = 1024
        doc["rollout"].update(rows=rows, horizon=1, max_new_tokens=2048, context_window=6144)
        # AReaL's PPO is token level with gamma = lam = 1 for MARFT and the parallel baseline alike.
        doc["algo"].update(level="token", gamma=1.0, lam=1.0, reward_bias=-0.5, reward_scale=10.0, reward_clip=20.0)
        doc["ppo"].update(micro_batches=rows // 4, clip_eps=0.4, value_clip_eps=0.5, value_loss="mse",
                          ent_coef=0.0, adv_norm="none", kl_stop=None, max_grad_norm=1.0,
                          critic_max_grad_norm=1.0)
        doc["optim"].update(policy_lr=3.0e-5, critic_lr=3.0e-5, eps=1.0e-8, weight_decay=0.01)
    return doc


def data_lines(task: str) -> str:
    """Comment lines: where the task's splits come from (the pinned Hub datasets)."""
    splits = HUB_TASKS[TASKS[task][0]["name"]]
    return "".join(f"# {split} data: dataset {f.repo}@{f.revision[:12]}, {f.file}\n" for split, f in splits.items())


def header(task: str, team: str, method: str, model: str, g2: bool) -> str:
    mode, level, _, _ = METHODS[method]
    what = {"marft-a": "MARFT-A (action level)", "marft-t": "MARFT-T (token level, gamma = lam = 1)",
            "ippo": "independent PPO baseline (parallel agents, shaped reward 0.5 own + 0.5 team mean)"}[method]
    hp = ("G2 (AReaL-based MARFT) hyper-parameters, reference section 13: token level, gamma = lam = 1,\n"
          "# LoRA r32/a16, lr 3e-5 const,"
          " clip 0.4, no advantage normalization, reward (r - 0.5) * 10 clipped to 20,\n# MSE value loss,"
          " value clip 0.5, no entropy, no KL stop, grad clip 1.0, single-turn episodes, 2048 new tokens."
          if g2 else
          "marft_jax defaults column of reference section 13 (G1-derived): policy lr 1e-6, critic lr 5e-5,\n"
          "# LoRA r8/a16 on q/v, horizon 3, 512 new tokens in a 2048 window, clip 0.2, KL stop 0.02.")
    note = ""
    if method == "ippo" and not g2:
        note = ("# Horizon 3 like the MARFT runs it is compared with (the references use 1 for IPPO); an\n"
                "# episode ends when the agents' mean score reaches rollout.success_threshold.\n")
    return (f"# GENERATED by experiments/make_paper_presets.py; edit the table there and rerun.\n"
            f"# {task} | team {team} ({TEAMS[team]} agent(s)) | {what} | {model}\n"
            f"# {hp}\n{note}"
            f"# Model and data come from the Hugging Face Hub at pinned commits, into its cache (HF_HOME;\n"
            f"# offline with HF_HUB_OFFLINE=1 once cached): model {MODELS[model][0]}@{MODELS[model][1][:12]};\n"
            f"{data_lines(task)}"
            f"# Evaluation (section 12): T 0.6; run seeds 0-4 with `train.seed=N` and report mean +- std.\n")


class _Dumper(yaml.SafeDumper):
    """Block mappings, one key a line; lists inline (``targets: [q_proj, v_proj]``)."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def render(spec: tuple[str, str, str, str, bool]) -> str:
    body = yaml.dump(build(*spec), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    return header(*spec) + body


def expected_files() -> dict[Path, str]:
    names = [preset_name(*spec) for spec in GRID]
    if len(set(names)) != len(names):
        raise ValueError("duplicate entries in GRID")
    return {OUT_DIR / f"{preset_name(*spec)[len('paper/'):]}.yaml": render(spec) for spec in GRID}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    args = p.parse_args(argv)
    files = expected_files()
    stale = [f for f in OUT_DIR.glob("*.yaml") if f not in files]
    changed = [f for f, text in files.items() if not f.is_file() or f.read_text(encoding="utf-8") != text]
    if args.check:
        for f in changed:
            print(f"out of date: {f}")
        for f in stale:
            print(f"not in GRID: {f}")
        return 1 if changed or stale else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for f in changed:
        f.write_text(files[f], encoding="utf-8")
    for f in stale:
        f.unlink()
    print(f"{len(files)} presets in {OUT_DIR} ({len(changed)} written, {len(stale)} removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
