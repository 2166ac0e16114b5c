"""Dynamic loss scaling for fp16 gradients that live in shards: an overflow on any rank skips the step everywhere."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_zero._grouping import group_by


class StepVerdict(Enum):
    """What the last unscale found in this rank's gradient shards and, through one all-reduce, in everyone's."""

    NONE = auto()  # no gradients checked since the last step
    FINITE = auto()  # every rank's gradients are finite: step
    OVERFLOW = auto()  # some rank saw an inf or nan: skip the step on every rank and lower the scale


class LossScaler:
    """Multiplies the loss by ``scale`` before backward; unscales the reduced gradient shards, agrees across ranks on
    whether any overflowed, and adapts the scale as ``torch.amp.GradScaler`` does."""

    def __init__(
        self,
        group: ProcessGroup,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.group = group
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # finite steps since the scale last changed
        self.verdict = StepVerdict.NONE

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide ``grads`` (this rank's, in place) by the scale and settle, across ranks, whether any overflowed."""
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, device=device)
        if grads:
            inv_scale = torch.full((1,), 1.0 / self.scale, device=device)
            for same_dtype in group_by(grads, lambda g: g.dtype).values():
                torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
        with torch.profiler.record_function("lightning_zero::agree_on_overflow"):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        overflow = bool(found_inf.item()) or self.verdict is StepVerdict.OVERFLOW  # sticky within a window
        self.verdict = StepVerdict.OVERFLOW if overflow else StepVerdict.FINITE

    def update(self) -> None:
        """After a step (taken or skipped): back off on overflow, grow after ``growth_interval`` clean steps."""
        if self.verdict is StepVerdict.OVERFLOW:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        elif self.verdict is StepVerdict.FINITE:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        self.verdict = StepVerdict.NONE

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
