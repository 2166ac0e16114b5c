"""Bytes of model state a rank holds, measured by walking tensors (deduplicated by storage), not process RSS."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

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


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local part)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0 or local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(module: nn.Module, optimizers: Iterable[Optimizer], engine: object | None = None) -> ModelStateBytes:
    """What this rank holds for ``module`` and ``optimizers``; ``engine`` is the stage 1/2 engine, if any."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    masters: list[torch.Tensor] = []
    if engine is not None:
        for bucket in engine.reducer.buckets:
            kept = bucket.shard_grads if bucket.shard_grads is not None else bucket.buffer
            if kept is not None:
                grads.append(kept)
        masters = [s.master for s in engine.sharded if s.has_master]
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


def communication_bytes(engine: object | None = None) -> int:
    """Bytes this process keeps for communication between steps: the stage 1/2 engine's reusable bucket buffers
    and the shared memory mapped for the collectives of CPU ranks on one host (segments, stage 3's gather ring)."""
    pool = engine.pool.nbytes() if engine is not None else 0  # type: ignore[attr-defined]
    return pool + shared_memory.mapped_bytes()
