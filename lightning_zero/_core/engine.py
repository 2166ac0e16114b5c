"""Stages 1 and 2: the module keeps full parameters; the engine shards optimizer state (and stage 2's gradients)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_zero._checkpoint.live import load_full_optimizer_state
from lightning_zero._core.mode import Mode, sync_from_rank_zero
from lightning_zero._core.precision import take_over_scaler
from lightning_zero._engine.engine import EnginePrecision, EngineState, ZeroEngine
from lightning_zero._engine.optimizer import ZeroOptimizer
from lightning_zero._engine.reducers import ReduceMode, reducer_for


class EngineMode(Mode):
    """Full parameters in the module, gradients reduced in buckets during backward (all-reduced in stage 1,
    reduce-scattered in stage 2), the optimizers stepping on this rank's shards, shards gathered after the step."""

    def _place(self, module: nn.Module) -> None:
        self._detach()  # an earlier `fit`'s engine; a new one is built for this one
        self.engine = None
        module.to(self.device)
        if dist.get_world_size() > 1:
            sync_from_rank_zero(module, dist.group.WORLD)

    def _wrap_optimizers(self, module: nn.Module, optimizers: list[Optimizer], precision: Any) -> list[Optimizer]:
        if self.engine is None:
            replaces_grad_scaler = take_over_scaler(precision)
            dtypes = EnginePrecision.of(self.config, module, replaces_grad_scaler=replaces_grad_scaler)
            reducer = reducer_for(self.config.stage)
            mesh, bucket_bytes = self._mesh(), self.config.bucket_bytes
            self.engine = ZeroEngine(module, reducer, mesh, bucket_bytes, dtypes, self.placement)
            precision.zero_loss_scaler = self.engine.scaler
        return [self.engine.shard_optimizer(optimizer) for optimizer in optimizers]

    @property
    def group(self) -> ProcessGroup | None:
        if self.engine is None or self.engine.state is not EngineState.ATTACHED:
            return None
        return self._mesh().world  # every data-parallel rank, not the shard group of hybrid sharding

    @property
    def gradient_sync(self) -> bool:
        return self.engine is None or self.engine.reducer.mode is ReduceMode.SYNC

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Stage 1 accumulates full gradients locally; stage 2 keeps reducing each backward into its gradient shards,
        so full gradients never accumulate (its reducer ignores the local mode)."""
        if self.engine is None:
            yield
            return
        reducer = self.engine.reducer
        previous, reducer.mode = reducer.mode, ReduceMode.LOCAL
        try:
            yield
        finally:
            reducer.mode = previous

    def load_module_state(self, module: nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
        super().load_module_state(module, state_dict, strict)
        if self.engine is not None:
            self.engine.masters_from_module()

    def _load_full_optimizer_state(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        if isinstance(optimizer, ZeroOptimizer):
            load_full_optimizer_state(optimizer, state_dict)
        else:
            super()._load_full_optimizer_state(optimizer, state_dict)

    def teardown(self) -> None:
        """Detached, not dropped: a checkpoint saved after training still writes each rank's shards only."""
        self._detach()
        super().teardown()

    def _detach(self) -> None:
        if self.engine is not None:
            self.engine.detach()
