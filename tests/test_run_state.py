"""The run state beside the train state (issue 40): one object, saved and restored with the
checkpoint, held by a frozen learner on a 1-device mesh."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from marft_jax.models.config import ModelConfig
from marft_jax.rl.update import UpdateConfig
from marft_jax.train.checkpoint import CheckpointManager
from marft_jax.train.iteration import TeamLearner
from marft_jax.train.run_state import CHECKPOINT_KEY

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8)
AUTO = ["none", "dots_no_batch", "full"]


def _learner(remat: str | None = None) -> TeamLearner:
    """A learner with only what its run state reads (no model, sampler or team)."""
    return TeamLearner(cfg=CFG, base=None, tokenizer=None, sampler=None, team=None, score_fn=None,
                       rollout_cfg=None, update_cfg=UpdateConfig(remat=remat), adv_cfg=None)


def test_a_resumed_run_restores_the_run_state_through_one_call(tmp_path):
    """Context bucket, the three packed-shape policies and the remat choice round-trip through a
    checkpoint's extra (the trainer's save and restore); the resumed learner plans only the
    recorded remat, while its checked update signatures start afresh (this machine's memory)."""
    learner = _learner()
    with pytest.raises(dataclasses.FrozenInstanceError):
        learner.update_cfg = UpdateConfig(remat="full")
    assert learner.placement.mesh.devices.size == 1                  # one device: a 1-device mesh
    rs = learner.run_state
    assert rs.remat_candidates(None, accelerator=True) == AUTO
    assert rs.remat_candidates(None, accelerator=False) == [None]
    rs.grow_context(96)
    rs.grow_context(64)                                                  # the bucket never shrinks
    rs.update.seen = [((8, 64), (4, 128))]
    rs.prepare.features.seen = [((16, 32),)]
    rs.prepare.logprobs.seen = [((4, 64),), ((8, 64),)]
    rs.choose_remat("dots_no_batch")
    rs.choose_remat("full")                                              # the first choice stays
    rs.checked_updates.add("a signature")
    assert learner.update_config().remat == "dots_no_batch"

    with CheckpointManager(tmp_path, async_save=False) as ckpt:
        assert ckpt.save(3, {"x": jnp.arange(3.0)}, {"iteration": 3, CHECKPOINT_KEY: rs.to_json()})
        _, extra = ckpt.restore(target_state={"x": jnp.zeros(3)})
    resumed = _learner()
    resumed.run_state.restore(extra)
    got = resumed.run_state
    assert got.to_json() == rs.to_json()
    assert got.context_bucket == 96 and got.update.seen == [((8, 64), (4, 128))]
    assert got.prepare.logprobs.seen == [((4, 64),), ((8, 64),)]
    assert got.remat_candidates(None, accelerator=True) == ["dots_no_batch"]
    assert resumed.update_config().remat == "dots_no_batch" and not got.checked_updates
    # the policies keep the learner's tuning (attention cost of this model, one class for forwards)
    for name, policy in got.policies.items():
        assert policy.attention_cost == rs.policies[name].attention_cost
    assert got.prepare.features.max_classes == 1
    # an explicit model.remat holds over a recorded choice
    explicit = _learner(remat="full")
    explicit.run_state.restore(extra)
    assert explicit.update_config().remat == "full"
    assert explicit.run_state.remat_candidates("full", accelerator=True) == ["full"]
    # dataclasses.replace of the frozen learner shares its run state
    assert dataclasses.replace(resumed, pack_sequences=False).run_state is got


def test_checkpoints_from_before_the_run_state_still_resume():
    """Older checkpoints kept ``context_bucket`` and ``packed_shapes`` as extra keys and no remat
    choice: they restore, and auto chooses the remat again."""
    learner = _learner()
    learner.run_state.restore({"iteration": 2, "context_bucket": 128,
                               "packed_shapes": {"update": [[8, 64]], "features": [[[4, 32], [2, 64]]]}})
    rs = learner.run_state
    assert rs.context_bucket == 128 and rs.update.seen == [((8, 64),)]
    assert rs.prepare.features.seen == [((4, 32), (2, 64))] and rs.prepare.logprobs.seen == []
    assert not rs.remat_chosen and rs.remat_candidates(None, accelerator=True) == AUTO
