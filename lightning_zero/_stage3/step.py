"""What a step of a stage-3 module obeys, however its units are gathered: it runs as the root's forward, its loss is
not a shard, its evaluation loops have one length on every rank, and whole tensors load into it as this rank's rows."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_zero._checkpoint.whole import rows_of

_MIXED = "got mixed torch.Tensor and DTensor"
_SHARD_OUTSIDE_FORWARD = (
    "Under ZeRO stage 3 a parameter of a unit (a submodule sharded on its own) is gathered only inside that unit's"
    " forward and backward; read anywhere else in the step it is this rank's shard, a DTensor. HINT: use it inside"
    " the unit's `forward`, or keep its module in the root unit (gathered for the whole step) with an"
    " `auto_wrap_policy` that does not pick it or a module around it."
)


def run_as_root_forward(forward: Callable[[], Any]) -> Any:
    """Run ``forward``: a LightningModule hook (``training_step``, ...) called as the root's forward through
    Lightning's forward redirection, so that the root unit is gathered for the whole step, whatever the step calls,
    and the root's hooks run even when the step never calls ``self(...)``. A parameter of a smaller unit read outside
    its unit's forward is a shard: the error says so."""
    with ExitStack() as stack:
        if torch.is_inference_mode_enabled():  # gathered parameters must stay usable by the next training step
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.no_grad())
        try:
            return forward()
        except RuntimeError as error:
            if _MIXED not in str(error):
                raise
            raise RuntimeError(f"{error}\n{_SHARD_OUTSIDE_FORWARD}") from error


def rows_of_whole_tensors(owner: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Before ``load_state_dict`` copies into ``owner``'s parameters: a whole tensor (a full state dict, what
    ``"ddp"`` saves) for a sharded parameter becomes the DTensor of this rank's rows of it, so that the shard takes
    those rows; one of another shape is left for ``load_state_dict``'s own size check."""
    for name, param in owner._parameters.items():
        value = state_dict.get(prefix + name)
        whole = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        if whole and isinstance(param, DTensor) and value.shape == param.shape:
            state_dict[prefix + name] = rows_of(value, param)


def check_plain_loss(loss: object) -> None:
    """Refuse a loss computed from a unit's shard before it reaches backward."""
    if isinstance(loss, DTensor):
        raise RuntimeError(f"The loss is a DTensor of placements {loss.placements}.\n{_SHARD_OUTSIDE_FORWARD}")


def check_even_batches(counts: list[float], loop: str, group: ProcessGroup) -> None:
    """Before an evaluation loop (``"validation"``, ``"test"`` or ``"predict"``): every rank must run the same number
    of batches, or the ranks that run more would wait forever in a unit's all-gather. One collective compares the
    ``counts`` (one per dataloader) of all ranks; an unknown count (``inf``: an iterable without a length) cannot be
    compared."""
    everyone: list[list[float]] = [[] for _ in range(group.size())]
    with torch.profiler.record_function("lightning_zero::check_even_batches"):
        dist.all_gather_object(everyone, [float(c) for c in counts], group=group)
    if all(c == everyone[0] for c in everyone) and math.inf not in everyone[0]:
        return
    shown = ", ".join(f"rank {r}: {[c if c == math.inf else int(c) for c in cs]}" for r, cs in enumerate(everyone))
    limit = "val" if loop == "validation" else loop
    raise RuntimeError(
        f"ZeRO stage 3 needs every rank to run the same, known number of {loop} batches (each forward all-gathers"
        f" parameters from all ranks), but the dataloaders give {shown}. HINT: keep Lightning's distributed sampler"
        " (`Trainer(use_distributed_sampler=True)`, which pads every rank to the same length), give every rank a"
        f" dataset of the same size, or set `limit_{limit}_batches` to an int that every rank reaches."
    )
