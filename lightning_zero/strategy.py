"""The Lightning strategies: they coordinate setup and hooks, and delegate the ZeRO work to the engine."""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import _collectives as comm
from lightning_zero._checkpoint import (
    load_directory,
    load_full_optimizer_state,
    named_optimizer_state,
    save_directory,
    sharded_model_state,
)
from lightning_zero._config import Stage, ZeroConfig
from lightning_zero._engine import EngineState, ZeroEngine
from lightning_zero._optimizer import ZeroOptimizer
from lightning_zero._precision import zero_aware
from lightning_zero._reducers import AllReduceReducer, GradientReducer, ReduceMode, ReduceScatterReducer

_SUPPORTED_DEVICES = ("cpu", "cuda")


def _reducer_for(stage: Stage) -> type[GradientReducer]:
    match stage:
        case Stage.OPTIMIZER:
            return AllReduceReducer
        case Stage.GRADIENTS:
            return ReduceScatterReducer


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism for any LightningModule, with no change to its code.

    Stage 1 shards optimizer state across ranks; stage 2 also shards gradients. Outside the optimizer step every
    rank holds full, current parameters, as under DDP. On a single device it trains plainly, with no collectives.

    Args:
        stage: 1 or 2. ``Zero1Strategy`` and ``Zero2Strategy`` fix it.
        bucket_cap_mb: size in MiB of the buckets gradients are reduced and parameters gathered in.
        broadcast_buffers: broadcast buffers from rank 0 before each synchronised training step, as DDP does.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
    """

    default_stage: Stage = Stage.GRADIENTS

    def __init__(
        self,
        stage: int | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        broadcast_buffers: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {sorted(unknown)}. HINT: the ZeRO options are `stage`,"
                " `bucket_cap_mb` and `broadcast_buffers`; the rest are those of Lightning's `DDPStrategy`."
            )
        if stage is not None and type(self) is not ZeroStrategy and stage != self.default_stage:
            raise ValueError(
                f"{type(self).__name__} runs stage {int(self.default_stage)}, not `stage={stage!r}`."
                f" HINT: use `ZeroStrategy(stage={stage!r})` or the matching `Zero{stage}Strategy`."
            )
        self.config = ZeroConfig.from_options(
            stage=self.default_stage if stage is None else stage,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._engine: ZeroEngine | None = None
        self._buffers_due = True  # whether the next step starts by broadcasting rank 0's buffers

    @property
    def stage(self) -> Stage:
        return self.config.stage

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = zero_aware(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = None if precision_plugin is None else zero_aware(precision_plugin)

    @override
    def setup_environment(self) -> None:
        device_type = self.root_device.type
        if device_type not in _SUPPORTED_DEVICES:
            raise ValueError(
                f"{type(self).__name__} runs on {' and '.join(_SUPPORTED_DEVICES)}, not on `{device_type}`."
                " HINT: pass `Trainer(accelerator='cpu')` or `accelerator='gpu'`."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self._remove_engine()  # from an earlier `fit`; a new one is built for this one
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.world_size > 1:
            _sync_module_states(self.model)  # every rank starts from rank 0's weights, as under DDP
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            _check_optimizer(optimizer)
        self._remove_engine()
        if self.world_size == 1:
            return
        assert self.lightning_module is not None
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        self._engine = ZeroEngine(self.lightning_module, _reducer_for(self.stage), mesh, self.config.bucket_bytes)
        self._buffers_due = True
        self.optimizers = [self._engine.shard_optimizer(optimizer) for optimizer in self.optimizers]

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches before the last of an accumulation window: stage 1 accumulates locally; stage 2 keeps
        reducing each backward into its gradient shards, so full gradients never accumulate."""
        if self._engine is None:
            yield None
            return
        reducer = self._engine.reducer
        previous, reducer.mode = reducer.mode, ReduceMode.LOCAL
        try:
            yield None
        finally:
            reducer.mode = previous

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._sync_buffers_before_forward()
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._sync_buffers_before_forward()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._sync_buffers_before_forward()
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_buffers_before_forward()
        return super().predict_step(*args, **kwargs)

    def _sync_buffers_before_forward(self) -> None:
        """Broadcast rank 0's buffers when the previous step was a synchronised training step, DDP's exact rule:
        so BatchNorm statistics evolve as they would under ``"ddp"``."""
        engine = self._engine
        if engine is None or engine.state is EngineState.DETACHED or not self.config.broadcast_buffers:
            return
        if self._buffers_due:
            assert self.lightning_module is not None
            with torch.no_grad():
                comm.broadcast_(list(self.lightning_module.buffers()), engine.group)
        self._buffers_due = torch.is_grad_enabled() and engine.reducer.mode is ReduceMode.SYNC

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a sharded checkpoint loads into the shards, which exist only after setup

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return sharded_model_state(self.lightning_module, self._engine)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return named_optimizer_state(optimizer, self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its own shards into the directory ``filepath``, published atomically when complete."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} writes sharded checkpoint directories itself and takes no `storage_options`."
                " HINT: drop `storage_options`; use `lightning_zero.consolidate_checkpoint` for a single file."
            )
        assert self.lightning_module is not None
        path = Path(self.broadcast(str(filepath)))
        save_directory(checkpoint, self.lightning_module, path, self.global_rank, self.barrier)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A checkpoint directory loads straight into the live shards; an ordinary file loads as Lightning does."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        return load_directory(path, self.lightning_module, self._engine, optimizers)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # absent when a checkpoint directory was loaded in place
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if not states:  # a checkpoint directory was loaded in place
            return
        for optimizer, state in zip(self.optimizers, states, strict=True):
            if isinstance(optimizer, ZeroOptimizer):
                load_full_optimizer_state(optimizer, state)
            else:
                optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)

    @override
    def teardown(self) -> None:
        # Detached, not dropped: a checkpoint saved after `fit` still writes each rank's shards only.
        if self._engine is not None:
            self._engine.detach()
        super().teardown()

    def _remove_engine(self) -> None:
        if self._engine is not None:
            self._engine.detach()
            self._engine = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for strategy in (Zero1Strategy, Zero2Strategy):
            stage = int(strategy.default_stage)
            strategy_registry.register(
                f"zero{stage}",
                strategy,
                description=f"ZeRO stage {stage}: {strategy.__doc__.splitlines()[0]}",
                override=True,
            )


class Zero1Strategy(ZeroStrategy):
    """Shards optimizer state; every rank keeps full parameters and full averaged gradients."""

    default_stage = Stage.OPTIMIZER


class Zero2Strategy(ZeroStrategy):
    """Shards optimizer state and gradients; full gradients are freed as soon as their bucket is reduced."""

    default_stage = Stage.GRADIENTS


def _check_optimizer(optimizer: object) -> None:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    if not isinstance(optimizer, Optimizer) or isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"`configure_optimizers` returned {type(optimizer).__name__}, which is not a `torch.optim.Optimizer`."
            " HINT: return an optimizer from `torch.optim` (or a subclass of `torch.optim.Optimizer`) built on"
            " `self.parameters()`; ZeRO shards its state itself."
        )
