"""Stages 1 and 2: the module keeps full parameters; the engine shards optimizer state (and stage 2's gradients)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero._checkpoint.live import OptimizerEntries
from lightning_zero._core.mode import LifeCycle, Mode, sync_from_rank_zero
from lightning_zero._core.optimizers import as_set_up
from lightning_zero._engine.engine import EnginePrecision, ZeroEngine
from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.optimizer import ZeroOptimizer
from lightning_zero._engine.reducers import GradientReducer, ReduceMode, reducer_for
from lightning_zero.memory import BufferHolder


class EngineMode(Mode):
    """Full parameters in the module, gradients reduced in buckets during backward (all-reduced in stage 1,
    reduce-scattered in stage 2), the optimizers stepping on this rank's shards, shards gathered after the step."""

    replaces_grad_scaler = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # built with the optimizers; after training detached, not dropped: a checkpoint saved then still writes each
        # rank's shards only
        self.engine: ZeroEngine | None = None
        self._masters_follow: RemovableHandle | None = None  # the module's load_state_dict hook, with the engine

    def _place(self, module: nn.Module) -> None:
        self._detach()  # an earlier `fit`'s engine; a new one is built for this one
        self.engine = None
        if self._masters_follow is not None:
            self._masters_follow.remove()
            self._masters_follow = None
        module.to(self.device)
        if dist.get_world_size() > 1:
            sync_from_rank_zero(module, dist.group.WORLD)

    def _wrap_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], grad_scaler_taken: bool
    ) -> list[Optimizer]:
        if self.state is not LifeCycle.TRAINING:  # the first optimizers of this `fit` (Fabric sets up one at a time)
            dtypes = EnginePrecision.of(self.config, module, replaces_grad_scaler=grad_scaler_taken)
            reducer = reducer_for(self.config.stage)
            mesh, bucket_bytes = self._mesh(), self.config.bucket_bytes
            wire, _ = self._zero_plus_plus(mesh)
            self.engine = ZeroEngine(module, reducer, mesh, bucket_bytes, dtypes, self.placement, wire)
            # whatever loads whole tensors into the module (a checkpoint, the user's `load_state_dict`, torch's
            # `set_model_state_dict`) loads the masters the optimizer steps on too
            self._masters_follow = module.register_load_state_dict_post_hook(self._masters_from_module)
        assert self.engine is not None
        return [self.engine.shard_optimizer(optimizer) for optimizer in optimizers]

    @property
    def loss_scaler(self) -> LossScaler | None:
        return None if self.engine is None else self.engine.scaler

    @property
    def buffers(self) -> BufferHolder | None:
        return self.engine

    def model_entries(self, module: nn.Module) -> dict[str, Any]:
        """Each sharded parameter as the DTensor over this rank's master (the fp32 one where there is one)."""
        state = super().model_entries(module)
        return state if self.engine is None else self.engine.with_masters(module, state)

    def optimizer_entries(self, optimizer: Optimizer) -> OptimizerEntries:
        """A sharded optimizer's state is laid out like the shards it updates."""
        optimizer = as_set_up(optimizer)
        if isinstance(optimizer, ZeroOptimizer):
            return OptimizerEntries(optimizer, optimizer.updated_tensors(), self.placement.state_like)
        return super().optimizer_entries(optimizer)

    def after_load(self) -> None:
        super().after_load()
        if self.engine is not None:
            with torch.no_grad():
                self.engine.module_from_masters()  # the module's rows from the masters, and the other ranks' rows

    def _reducer(self) -> GradientReducer | None:
        """The engine's reducer while it reduces gradients (training)."""
        if self.state is not LifeCycle.TRAINING or self.engine is None:
            return None
        return self.engine.reducer

    @property
    def _sync_group(self) -> ProcessGroup | None:
        if self._reducer() is None:
            return None
        return self._mesh().world  # every data-parallel rank, not the shard group of hybrid sharding

    @property
    def _gradient_sync(self) -> bool:
        reducer = self._reducer()
        return reducer is None or reducer.mode is ReduceMode.SYNC

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Stage 1 accumulates full gradients locally; stage 2 keeps reducing each backward into its gradient shards,
        so full gradients never accumulate (its reducer ignores the local mode)."""
        reducer = self._reducer()
        if reducer is None:
            yield
            return
        previous, reducer.mode = reducer.mode, ReduceMode.LOCAL
        try:
            yield
        finally:
            reducer.mode = previous

    def _masters_from_module(self, module: nn.Module, incompatible: Any) -> None:
        if self.engine is not None:
            self.engine.masters_from_module()

    def teardown(self) -> None:
        self._detach()
        super().teardown()

    def _detach(self) -> None:
        if self.engine is not None:
            self.engine.detach()
