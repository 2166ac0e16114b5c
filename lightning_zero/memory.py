"""Bytes of model state a rank holds, measured by walking tensors (deduplicated by storage), not process RSS."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero._stage3.lazy import LazyTensor
from lightning_zero._transport import shared_memory


@dataclass(frozen=True)
class ModelStateBytes:
    """One rank's model-state bytes by category."""

    parameters: int  # the module's parameters (full in stages 1 and 2, shards in stage 3)
    gradients: int  # reduced gradients kept between backward and step: full, or this rank's shards
    master_weights: int  # fp32 master copies of this rank's shards, in the ZeRO mixed-precision mode
    optimizer_state: int  # the optimizer's state (moments, step counters), this rank's part

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_state


class BufferHolder(Protocol):
    """What a ZeRO mode holds beyond the module's parameters and the optimizers' state (the stage 1/2 engine)."""

    def gradient_buffers(self) -> list[torch.Tensor]:
        """Gradient storage kept between steps besides ``param.grad``: buckets, gradient shards."""
        ...

    def master_weights(self) -> list[torch.Tensor]:
        """Master copies of this rank's shards, where they are not the module's own rows."""
        ...

    def communication_bytes(self) -> int:
        """Bytes of reusable communication buffers kept between steps."""
        ...


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local part)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0 or local.device.type == "meta" or isinstance(local, LazyTensor):
            continue  # no storage: a lazy tensor's values are given at set-up
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(
    module: nn.Module, optimizers: Iterable[Optimizer], buffers: BufferHolder | None = None
) -> ModelStateBytes:
    """What this rank holds for ``module`` and ``optimizers``; ``buffers``: what the mode holds besides (its
    ``buffers``, the stage 1/2 engine), if anything."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    masters: list[torch.Tensor] = []
    if buffers is not None:
        grads += buffers.gradient_buffers()
        masters = buffers.master_weights()
    state = [
        value
        for optimizer in optimizers
        for entries in optimizer.state.values()
        for value in entries.values()
        if isinstance(value, torch.Tensor)
    ]
    return ModelStateBytes(
        parameters=storage_bytes(params),
        gradients=storage_bytes(grads),
        master_weights=storage_bytes(masters),
        optimizer_state=storage_bytes(state),
    )


def engine_of(strategy: object) -> object | None:
    """The stage 1/2 engine of a ZeRO strategy (its buffers count as gradients), ``None`` for any other strategy or
    stage, or before training."""
    return getattr(getattr(strategy, "mode", None), "engine", None)


def communication_bytes(buffers: BufferHolder | None = None) -> int:
    """Bytes this process keeps for communication between steps: the mode's reusable buffers (stage 1/2 buckets)
    and the shared memory mapped for the collectives of CPU ranks on one host (segments, stage 3's gather ring)."""
    held = buffers.communication_bytes() if buffers is not None else 0
    return held + shared_memory.mapped_bytes()
