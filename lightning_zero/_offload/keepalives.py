"""Fewer copies of a unit alive at once on the CPU (``offload_parameters="disk"``): what ``fully_shard`` keeps alive
for a CUDA stream to wait on is freed as soon as its unit is done with it.

On a GPU, ``fully_shard`` gathers and reduces on streams of their own, so it keeps the output of a unit's all-gather
until the next unit's gather is copied out, and the input of a unit's reduce-scatter until the next unit reduces:
freed earlier, their memory could be handed out while a stream still reads it. On the CPU nothing runs on a stream
and each collective is waited for before its buffers are read, so these keepalives only hold memory: a whole unit's
parameters for the forward of the next unit, and a whole unit's gradients for the backward of the next, on top of
the unit gathered, its gradients and the one gathered ahead. Under a memory limit that is the difference between a
model that fits and one that does not (see the offload guide's "what the limit must hold"). Freeing them changes no
value: every buffer is freed after its last use, only sooner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves

from lightning_zero._stage3.seam import release_stream_keepalives


def free_after_use(units: list[nn.Module]) -> None:
    """After each unit's forward, free its all-gather's output; before each unit's backward, the reduce-scatter input
    of the unit reduced before it."""
    for unit in units:
        assert isinstance(unit, FSDPModule)
        # before fully_shard's own post-forward, so that the hook below comes before its pre-backward's gather
        unit.register_forward_hook(_after_forward, prepend=True)


def _after_forward(unit: nn.Module, args: Any, output: Any) -> None:
    assert isinstance(unit, FSDPModule)
    release_stream_keepalives(unit)
    outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outputs:  # fires as this unit's backward begins, after the unit after it has reduced, before it gathers
        torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: release_stream_keepalives(unit), mode="any")
