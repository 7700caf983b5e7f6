"""A tiny HF model directory with the embedded SmolLM2 tokenizer, for trainer/CLI tests."""

from __future__ import annotations

from pathlib import Path

from marft_jax.bench.iteration import write_tiny_model


def make_tiny_model_dir(root: Path) -> Path:
    """Write config.json, model.safetensors (random) and the embedded tokenizer to ``root``."""
    return write_tiny_model(root)


def tiny_overrides(model_dir: Path, out_dir: Path, run_name: str, **extra) -> list[str]:
    base = {
        "model.name": str(model_dir), "rollout.rows": 2, "rollout.max_new_tokens": 6,
        "rollout.agent_max_new_tokens": "null",
        "rollout.context_window": 512, "train.iterations": 4, "train.eval_problems": 2,
        "train.save_every": 2, "train.scoring_workers": 0, "train.out_dir": str(out_dir),
        "train.run_name": run_name, "train.time_budget_s": "null", "task.train_size": 50,
        "task.test_size": 10, "ppo.epochs": 1, "ppo.num_minibatches": 1, "optim.policy_lr": 1e-3,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
