"""The loop's integer keys: none can crash a run after start-up.

Every key the loop divides by or takes a modulo of is either refused at start-up (a
:class:`ConfigError` naming the key) or has a meaning for 0 that a test pins:
``train.save_every=0`` (only the final checkpoint, here) and ``train.eval_every=0`` (evaluate
before and after training only, the demo's setting, used by every tiny run of the suite).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from marft_jax.config import ConfigError, load_config

PACKAGE = Path(__file__).resolve().parents[1] / "marft_jax"

# 0 is a setting: what it means
ZERO_MEANS = {"train.save_every": "only the final checkpoint",
              "train.eval_every": "evaluate before and after training only",
              "train.scoring_workers": "score in the training process",
              "train.time_budget_s": "no time budget"}

# value -> refused at start-up
REFUSED = {
    "train.log_every": 0, "train.keep_last": 0, "train.save_every": -1, "train.eval_every": -1,
    "ppo.interval": 0, "ppo.num_minibatches": 0, "ppo.micro_batches": 0, "ppo.epochs": 0,
    "train.profile.steps": 0, "train.eval_batch_size": 0, "train.eval_problems": 0,
    "train.scoring_workers": -1, "train.time_budget_s": -1, "rollout.rows": 0, "rollout.horizon": 0,
    "rollout.max_new_tokens": 0, "rollout.max_steps": 0, "lora.rank": 0, "team.num_agents": 0,
    "dist.timeout_s": 0, "dist.heartbeat_timeout_s": 0,
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_value_the_loop_cannot_use_is_refused_at_start_up_naming_the_key(key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config("demo", [f"{key}={REFUSED[key]}"])


def test_every_divisor_the_loop_reads_from_the_config_is_refused_at_zero_or_has_a_meaning():
    """A scan of the loop's sources (train/, rl/): every ``x % cfg.KEY`` or ``x // cfg.KEY``."""
    pattern = re.compile(r"(?:%|//)\s*(?:self\.)?(?:cfg|rcfg|ucfg|acfg)\.((?:train|ppo|rollout|algo|optim)\.?[\w.]*)")
    keys = set()
    for path in [*(PACKAGE / "train").glob("*.py"), *(PACKAGE / "rl").glob("*.py")]:
        keys |= set(pattern.findall(path.read_text()))
    assert {"train.save_every", "train.eval_every", "train.log_every"} <= keys
    for key in keys:
        if key in ZERO_MEANS:
            load_config("demo", [f"{key}=0"])
        else:
            with pytest.raises(ConfigError, match=re.escape(key)):
                load_config("demo", [f"{key}=0"])


def test_save_every_zero_keeps_only_the_final_checkpoint(tiny_model_dir, tmp_path):
    from marft_jax.train.trainer import train
    from tests.tiny_run import tiny_overrides

    over = {"train.iterations": 2, "train.save_every": 0, "train.eval_before": "false", "train.eval_problems": 1,
            "train.keep_last": 5}
    out = train(load_config("demo", tiny_overrides(tiny_model_dir, tmp_path, "save0", **over)))
    assert out["iterations"] == 2 and "accuracy_after" in out
    assert sorted(p.name for p in (tmp_path / "save0" / "checkpoints").iterdir() if p.is_dir()) == ["step_00000002"]
