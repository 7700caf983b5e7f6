"""The mutable state of a run that lives beside its :class:`~marft_jax.rl.state.TrainState`:
what the run has compiled and chosen so far, which a resumed run must reuse to pack, pad and
compute exactly as the uninterrupted one.

* ``context_bucket``: the trajectory's padded context length; it only grows over a run.
* ``prepare`` / ``update``: the packed shapes (:class:`~marft_jax.rl.packing.ShapePolicy`) of the
  feature pass, the recompute forward and the update, reused while they fit.
* ``remat``: the update's remat policy, chosen once (``model.remat`` auto on an accelerator
  plans up to three; :meth:`~marft_jax.train.iteration.TeamLearner.check_update_memory`) and
  then recorded: a resumed run reuses it instead of planning again.
* ``checked_updates``: the update signatures whose memory plan this process has checked. It is
  not saved: a resumed process checks its first update against its own machine's memory
  (with the recorded remat only).

:meth:`RunState.to_json` is saved in a checkpoint's ``extra`` under :data:`CHECKPOINT_KEY`;
:meth:`RunState.restore` reads it back (or the ``context_bucket`` / ``packed_shapes`` keys that
checkpoints held before this object existed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marft_jax.models import causal_attention
from marft_jax.models.config import ModelConfig
from marft_jax.rl import packing
from marft_jax.train.prepare import PrepareShapes

CHECKPOINT_KEY = "run_state"        # the key of a checkpoint's extra dict that holds RunState.to_json()
_AUTO = "auto"                      # the JSON of a recorded remat of None (resolve_remat's row-length rule)


@dataclasses.dataclass
class RunState:
    """Context bucket, packed shapes and remat choice of a run (module docstring)."""

    context_bucket: int = 0
    prepare: PrepareShapes = dataclasses.field(default_factory=PrepareShapes)
    update: packing.ShapePolicy = dataclasses.field(default_factory=packing.ShapePolicy)
    remat_chosen: bool = False
    remat: str | None = None        # once chosen: the policy name (None: auto's row-length rule)
    checked_updates: set = dataclasses.field(default_factory=set, repr=False)

    @property
    def policies(self) -> dict[str, packing.ShapePolicy]:
        """The three packed-shape policies by their checkpoint names."""
        return {"update": self.update, "features": self.prepare.features, "logprobs": self.prepare.logprobs}

    def configure(self, cfg: ModelConfig, row_multiple: int, tokens_per_call: int | None = None) -> None:
        """Tune the shape policies to the model (attention's cost against the linear layers';
        for the forward-only passes with the native whole-row kernel, which skips other
        segments' keys, the slots alone, in rows of at most ``tokens_per_call`` slots where the
        units allow) and the row shards (every class's rows a multiple of ``row_multiple``)."""
        # Forward-only passes pack units end to end when the attention skips other segments' keys
        # (15 % fewer slots on the reference workload's feature pass). The update keeps rows per
        # unit: its agents share one shape, so the longer agent's units bound its slots either way,
        # and the kernel's backward ran 12-20 % slower over one long row than over rows of a unit
        # each (docs/benchmarks.md).
        segments = cfg.causal_attention == "native" and causal_attention.supports(cfg.head_dim)
        cost = packing.attention_cost_of(cfg)
        self.update.attention_cost = cost * packing.BACKWARD_ATTENTION_WEIGHT
        for policy in (self.prepare.features, self.prepare.logprobs):
            policy.attention_cost = 0.0 if segments else cost * packing.FORWARD_ATTENTION_WEIGHT
            policy.segment_attention = segments
            policy.segment_align = causal_attention.SEGMENT_ALIGN if segments else 1
            if tokens_per_call:
                policy.max_row_len = min(policy.max_row_len, int(tokens_per_call))
            # Forward-only passes: length classes save little there and each new shape compiles.
            policy.max_classes = 1
        for policy in self.policies.values():
            policy.row_multiple = row_multiple

    def grow_context(self, length: int) -> None:
        """Record a trajectory's context bucket (the bucket never shrinks)."""
        self.context_bucket = max(self.context_bucket, int(length))

    def remat_candidates(self, configured: str | None, *, accelerator: bool) -> list[str | None]:
        """The remat policies the update's memory plan tries, in order: ``model.remat`` when set
        (``configured``); else the recorded choice once made; else (auto) ``none``,
        ``dots_no_batch``, ``full`` on an accelerator, and on the CPU auto's row-length rule
        (None: ``full`` costs no time there)."""
        if configured is not None:
            return [configured]
        if self.remat_chosen:
            return [self.remat]
        return ["none", "dots_no_batch", "full"] if accelerator else [None]

    def remat_for(self, configured: str | None) -> str | None:
        """The update's remat policy: ``model.remat`` when set, else the recorded choice (None:
        auto's row-length rule, or nothing chosen yet)."""
        return configured if configured is not None else self.remat

    def choose_remat(self, remat: str | None) -> None:
        """Record the update's remat policy (the first choice stays)."""
        if not self.remat_chosen:
            self.remat_chosen, self.remat = True, remat

    def to_json(self) -> dict[str, Any]:
        """The saved part: context bucket, the shapes compiled so far and the remat choice."""
        as_lists = lambda policy: [[list(c) for c in shape] for shape in policy.seen]
        return {"context_bucket": self.context_bucket,
                "packed_shapes": {name: as_lists(p) for name, p in self.policies.items()},
                "remat": (self.remat or _AUTO) if self.remat_chosen else None}

    def load_json(self, doc: dict[str, Any]) -> None:
        """Restore :meth:`to_json` in place (the policies keep their tuning; missing entries:
        nothing compiled or chosen yet)."""
        self.context_bucket = int(doc.get("context_bucket", 0))
        shapes = doc.get("packed_shapes", {})
        for name, policy in self.policies.items():
            policy.seen = [packing.shape_from_json(x) for x in shapes.get(name, [])]
        remat = doc.get("remat")
        self.remat_chosen = remat is not None
        self.remat = None if remat in (None, _AUTO) else str(remat)

    def restore(self, extra: dict[str, Any]) -> None:
        """Restore from a checkpoint's ``extra``: its :data:`CHECKPOINT_KEY` entry, or the
        ``context_bucket`` / ``packed_shapes`` keys of older checkpoints (no remat recorded:
        it is chosen again)."""
        self.load_json(extra.get(CHECKPOINT_KEY, extra))
