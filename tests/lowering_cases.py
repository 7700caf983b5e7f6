"""The lowering cases of tests/test_lowering.py, run in one process per device count.

``python -m tests.lowering_cases D MODEL_DIR`` (in a process with D simulated CPU devices)
lowers, for ``cuda`` and ``tpu``, the programs of a tiny run (:data:`TINY_MODEL`, the lengths
of a real one: prompt buckets 16, 64 and 640, packed rows of 160, 640 and an odd 97 slots,
a planner-chosen shape of short sequences) with ``model.attention=auto`` and with each other
implementation of the platform, through :mod:`marft_jax.preflight`'s machinery, and prints one
JSON line per case. The mesh is (data, fsdp, tensor) = :data:`MESHES` [D].
"""

from __future__ import annotations

import dataclasses
import json
import sys

# Small widths, real head_dim (the TPU kernels tile it by 128) and grouped-query attention.
TINY_MODEL = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
              "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 4096,
              "torch_dtype": "bfloat16"}
MESHES = {1: (1, 1, 1), 4: (1, 2, 2), 8: (2, 2, 2)}
# model.remat=full: one update per case (auto would lower each policy the learner may pick).
OVERRIDES = ("rollout.rows=8", "rollout.horizon=2", "rollout.max_new_tokens=64", "rollout.context_window=768",
             "team.num_agents=2", "ppo.micro_batches=2", "train.eval_batch_size=8", "model.remat=full")
IMPLEMENTATIONS = {"cuda": ("auto", "pallas", "xla"), "tpu": ("auto", "pallas", "xla")}
PROMPTS = (16, 64, 640)         # prompt buckets of the prefill
ROW_LENGTHS = (160, 640, 97)    # single-class packed rows (97: an odd length)


# the critic-free estimator's run: no critic, its own "backup" program and a critic-free update
GROUP = ("algo.advantage=group", "rollout.group_size=4")


def config(model_dir: str, devices: int, attention: str = "auto", extra: tuple[str, ...] = ()):
    from marft_jax.config import load_config

    data, fsdp, tensor = MESHES[devices]
    return load_config(None, [*OVERRIDES, f"model.name={model_dir}", f"model.attention={attention}",
                              f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", *extra])


def programs(run, lrn, *, auto: bool):
    """The cases of one (platform, attention). A kernel (auto's choice and each other one): the
    prefill at :data:`PROMPTS`, the training forwards at :data:`ROW_LENGTHS`, the gradient (the
    update) at 97 slots and the concurrent agents' ``vmap`` at 160; ``auto`` adds the gradient at
    640, every decode phase, a planner-chosen shape (short sequences) and evaluation. ``xla``
    (the same code on every backend): one prefill and the update at the odd length."""
    from marft_jax import preflight

    cfg = run.config
    kernel = run.model.attention != "xla"
    yield from preflight.sampler_programs(run, lrn, batch=cfg.rollout.rows, sampling=cfg.rollout,
                                          prompt_lengths=PROMPTS if kernel else PROMPTS[:1], phases=auto)
    for row_len in ROW_LENGTHS if kernel else ROW_LENGTHS[-1:]:
        traj = preflight.synthetic_trajectory(cfg, "long", vocab=run.model.vocab_size, window=row_len, steps=1)
        schedules = ("concurrent",) if row_len == ROW_LENGTHS[0] else ("sequential",)
        for p in preflight.training_programs(run, lrn, traj, label=f"rows of {row_len}",
                                             shapes=preflight.fixed_shape_policies(lrn, traj, row_len),
                                             schedules=schedules):
            is_update = p.name.startswith("update")
            if (kernel or is_update) and not (is_update and row_len == 640 and not auto):
                yield p
    if auto:
        traj = preflight.synthetic_trajectory(cfg, "short", vocab=run.model.vocab_size)
        yield from preflight.training_programs(run, lrn, traj, label="short")
        sampling = dataclasses.replace(cfg.rollout, temperature=0.6, top_k=0, top_p=1.0)
        yield from preflight.sampler_programs(run, lrn, batch=cfg.train.eval_batch_size, sampling=sampling,
                                              label="eval ", prompt_lengths=(64,), phases=True)


def group_programs(run, lrn):
    """The ``group`` estimator's training programs (auto's kernel): the backup and the update
    without a critic, at the odd 97-slot rows and at a planner-chosen shape."""
    from marft_jax import preflight

    cfg = run.config
    traj = preflight.synthetic_trajectory(cfg, "long", vocab=run.model.vocab_size, window=ROW_LENGTHS[-1], steps=1)
    yield from preflight.training_programs(run, lrn, traj, label=f"group, rows of {ROW_LENGTHS[-1]}",
                                           shapes=preflight.fixed_shape_policies(lrn, traj, ROW_LENGTHS[-1]))
    traj = preflight.synthetic_trajectory(cfg, "short", vocab=run.model.vocab_size)
    yield from preflight.training_programs(run, lrn, traj, label="group, short")


def cases(model_dir: str, devices: int, emit=print) -> list[dict]:
    """Lower every case for cuda and tpu on ``devices`` devices; one dict (and JSON line) each."""
    from marft_jax import preflight

    import jax

    out = []
    for platform, impls in IMPLEMENTATIONS.items():
        jax.clear_caches()       # jit reuses a trace made for another platform (its kernel choice)
        seen = set()
        for attention in impls:
            cfg = config(model_dir, devices, attention)
            model, _ = preflight.model_architecture(model_dir)
            model = preflight.resolve_model(cfg, model, platform, devices)
            if model.attention in seen:      # auto's own choice is lowered once
                continue
            seen.add(model.attention)
            runs = [("gae", cfg, programs)]
            if attention == "auto":
                runs.append(("group", config(model_dir, devices, attention, GROUP), lambda r, l, auto: group_programs(r, l)))
            for estimator, run_cfg, make in runs:
                run = preflight.build(run_cfg, model, devices, platform)
                lrn = preflight.learner(run)
                for o in preflight.run_programs(make(run, lrn, auto=attention == "auto"), platform,
                                                model.attention, stop_at_first=False, emit=lambda s: None):
                    case = {"platform": platform, "devices": devices, "attention": model.attention,
                            "auto": attention == "auto", "estimator": estimator, "program": o.program.name,
                            "shape": o.program.shape, "ok": o.error is None, "seconds": round(o.seconds, 2),
                            "error": None if o.error is None else f"{type(o.error).__name__}: "
                                                                  f"{str(o.error).strip()[:400]}"}
                    out.append(case)
                    emit(json.dumps(case))
    return out


if __name__ == "__main__":
    cases(sys.argv[2], int(sys.argv[1]))
