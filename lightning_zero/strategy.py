"""The Lightning strategies: they coordinate setup and hooks, and delegate the ZeRO work to the engine (stages 1
and 2) or to torch's ``fully_shard`` (stage 3, see :mod:`lightning_zero._stage3`)."""

from __future__ import annotations

import atexit
import shutil
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.utils import _sync_module_states as _sync_states_except
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import _collectives as comm
from lightning_zero import _shared_memory as shared_memory
from lightning_zero._checkpoint import (
    load_directory,
    load_full_optimizer_state,
    load_full_optimizer_state_into_dtensors,
    named_optimizer_state,
    readable_directory,
    save_directory,
    sharded_model_state,
)
from lightning_zero._config import Stage, ZeroConfig
from lightning_zero._engine import EngineState, ZeroEngine, engine_precision
from lightning_zero._launcher import FullWeightsLauncher
from lightning_zero._meta_init import MetaInit, materialize
from lightning_zero._offload import (
    DiskState,
    OffloadTarget,
    backend_with_host,
    check_host_collectives,
    host_kernel,
    implementation,
    unchosen_groups,
)
from lightning_zero._optimizer import ZeroOptimizer, check_configured, unwrap
from lightning_zero._precision import zero_aware
from lightning_zero._reducers import ReduceMode, reducer_for
from lightning_zero._report import log_info, memory_report
from lightning_zero._stage3 import (
    ShardedModule,
    check_even_batches,
    check_plain_loss,
    offload_policy,
    precision_policy,
)
from lightning_zero._wrap import ModuleFilter, apply_activation_checkpointing, choose_units

_SUPPORTED_DEVICES = ("cpu", "cuda")


@atexit.register
def _close_process_group() -> None:
    """Lightning leaves the process group open after `fit`; torn down only by interpreter exit, gloo's worker threads
    can be destroyed still joinable ("terminate called without an active exception"). Close it first."""
    shared_memory.close_all()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's bucket size for the initial broadcast of rank 0's weights
ModuleOption = set[type[torch.nn.Module] | str] | list[type[torch.nn.Module] | str] | int | ModuleFilter | None


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism for any LightningModule, with no change to its code.

    Stage 1 shards optimizer state across ranks; stage 2 also shards gradients. Outside the optimizer step every
    rank holds full, current parameters, as under DDP. Stage 3 also shards the parameters (torch's ``fully_shard``):
    every rank holds only its rows of each, and a unit's parameters are gathered just for its forward and backward.
    On a single device every stage trains plainly, with no collectives.

    Args:
        stage: 1, 2 or 3. ``Zero1Strategy``, ``Zero2Strategy`` and ``Zero3Strategy`` fix it.
        bucket_cap_mb: size in MiB of the buckets gradients are reduced and parameters gathered in (stages 1, 2).
        broadcast_buffers: broadcast buffers from rank 0 before each synchronised training step, as DDP does.
        auto_wrap_policy: stage 3, which submodules become units: by default the entries of an ``nn.ModuleList`` or
            ``nn.Sequential`` whose class repeats; or a set of module classes (or import paths), an int parameter
            count (a submodule holding at least that many parameters outside smaller units), or a callable
            ``(module, qualified_name) -> bool``. Everything else stays in the LightningModule's root unit.
        activation_checkpointing: any stage, which submodules recompute their activations in backward (non-reentrant
            checkpointing): module classes, import paths, a parameter count or a callable as above, or ``True`` for
            the modules the wrap policy picks.
        master_weights: ZeRO mixed precision: fp32 master shards for a 16-bit module (``precision="bf16-true"``).
        reduce_dtype: stages 2 and 3, the dtype gradients are reduced in (``"float32"`` with a 16-bit module).
        offload_optimizer: ``True`` (or ``"cpu"``): fp32 masters, optimizer state and the optimizer step live in host
            memory (pinned on CUDA); gradients are copied there as they are reduced and the updated shards come
            back. ``"disk"``: the same, with the optimizer state in memory-mapped files under ``offload_dir``. In
            stage 3 the parameter shards are the optimizer's, so they live on the host too. Also on one device.
        offload_parameters: stage 3, keep the parameter shards on the host, each unit brought to the device only while
            it is gathered (implies the optimizer on the host).
        offload_dir: the directory of ``offload_optimizer="disk"``, on a local disk with room for the state.
        pin_memory: page-lock the host copies of a CUDA module's state (faster, asynchronous transfers).
        memory_report: log on rank 0, once per ``fit``, a table of this rank's model-state bytes (parameters,
            gradients, master weights, optimizer state) measured by walking tensors, beside the estimate of
            ``python -m lightning_zero estimate`` for the same stage, ranks and precision. It is logged right after
            the first optimizer step, the first moment at which gradients and optimizer state all exist (with several
            optimizers, only the one that stepped has state then), through Lightning's logging
            (``rank_zero_info``, logger ``lightning.pytorch``).
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
        auto_wrap_policy: ModuleOption = None,
        activation_checkpointing: bool | ModuleOption = None,
        master_weights: bool = False,
        reduce_dtype: str | torch.dtype | None = None,
        offload_optimizer: bool | Literal["cpu", "disk"] = False,
        offload_parameters: bool = False,
        offload_dir: str | Path | None = None,
        pin_memory: bool = True,
        memory_report: bool = True,
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
                " `bucket_cap_mb`, `broadcast_buffers`, `auto_wrap_policy`, `activation_checkpointing`,"
                " `master_weights`, `reduce_dtype`, `offload_optimizer`, `offload_parameters`, `offload_dir`,"
                " `pin_memory` and `memory_report`; the rest are those of Lightning's `DDPStrategy`."
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
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            master_weights=master_weights,
            reduce_dtype=reduce_dtype,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            offload_dir=offload_dir,
            pin_memory=pin_memory,
            memory_report=memory_report,
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
        self._sharded: ShardedModule | None = None  # stage 3 on more than one rank
        self._meta_init = MetaInit()
        self._buffers_due = True  # whether the next step starts by broadcasting rank 0's buffers
        self._disk: DiskState | None = None  # offload_optimizer="disk": the files holding optimizer state
        self._report_due = False  # whether the next optimizer step is the first of a `fit` that logs the report
        self._host_kernels: dict[int, str] = {}  # stage 3 offloaded: each optimizer's host kernel, by ``id``

    @property
    def stage(self) -> Stage:
        return self.config.stage

    @property
    def _sharding(self) -> bool:
        """Whether ZeRO's machinery runs: on several ranks, or on one device to offload to the host. Otherwise the
        module trains plainly, with the optimizer as configured and no collectives."""
        return self.world_size > 1 or self.config.offload is not OffloadTarget.DEVICE

    @override
    def _get_process_group_backend(self) -> str:
        if self.config.offload is OffloadTarget.DEVICE or self.root_device.type != "cuda":
            return super()._get_process_group_backend()
        return backend_with_host(self._process_group_backend)

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
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:  # notebooks: the main process gets the trained weights back, whole under every stage
            self._launcher = FullWeightsLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        device_type = self.root_device.type
        if device_type not in _SUPPORTED_DEVICES:
            raise ValueError(
                f"{type(self).__name__} runs on {' and '.join(_SUPPORTED_DEVICES)}, not on `{device_type}`."
                " HINT: pass `Trainer(accelerator='cpu')` or `accelerator='gpu'`."
            )
        super().setup_environment()
        if self.config.offload is not OffloadTarget.DEVICE and device_type == "cuda":
            check_host_collectives()

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
        if self.config.activation_checkpointing is not None:
            apply_activation_checkpointing(self.model, self.config.activation_checkpointing)
        match self.stage:
            case Stage.PARAMETERS if self._sharding:
                self._shard_parameters()
            case _:
                self.model_to_device()
                if self.world_size > 1:
                    _sync_module_states(self.model)  # every rank starts from rank 0's weights, as under DDP
        if fitting:
            self.setup_optimizers(trainer)
            self._report_due = self.config.memory_report
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_parameters(self) -> None:
        """Stage 3, before ``configure_optimizers``: checkpointing is applied; now ``fully_shard`` the units and the
        LightningModule, then give parameters created on the meta device their values, shard by shard."""
        assert self.lightning_module is not None
        module = self.lightning_module
        existing = ShardedModule.of(module)
        if existing is not None:  # a later `fit`, `validate`, `test` or `predict` of the module, by any Trainer
            self._sharded = existing
            existing.reshard()
            return
        resets = self._meta_init.plan(module)
        meta = {name for name, p in module.named_parameters() if p.is_meta}
        # Everything real goes to the device first, as under DDP: `fully_shard` moves only parameters and buffers,
        # not other module state (torchmetrics' metric states), and then offloads the shards itself.
        module._apply(lambda t: t if t.is_meta else t.to(self.root_device))
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        # every rank starts from rank 0's weights, as under DDP (meta ones are drawn from rank 0's generator)
        _sync_states_except(module, mesh.get_group(), _BROADCAST_BUCKET_BYTES, 0, meta)
        units = choose_units(module, self.config.auto_wrap_policy)
        precision, offload = precision_policy(self.config, module), offload_policy(self.config, self.root_device)
        self._sharded = ShardedModule(module, mesh, units, self.root_device, precision, offload)
        materialize(module, resets, self.root_device, self._sharded.group, shards_on_host=offload is not None)
        self._buffers_due = True

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        self._host_kernels = {}
        for optimizer in self.optimizers:
            check_configured(optimizer)
        self._remove_engine()
        if not self._sharding and self.config.master_weights:
            raise ValueError(
                "`master_weights=True` shards fp32 master weights across ranks; this run has one."
                " HINT: on one device use `Trainer(precision='bf16-mixed')`, which keeps fp32 weights, or offload"
                " the masters to the host with `offload_optimizer=True`."
            )
        if self.config.offload is OffloadTarget.DISK:
            assert self.config.offload_dir is not None
            self._disk = DiskState(self.config.offload_dir, self.global_rank)
        if not self._sharding or self.stage is Stage.PARAMETERS:
            return  # stage 3: the optimizer was built on `fully_shard`'s DTensor shards and steps on them as it is
        assert self.lightning_module is not None
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        precision = engine_precision(self.config, self.lightning_module, self.precision_plugin)
        self._engine = ZeroEngine(
            self.lightning_module, reducer_for(self.stage), mesh, self.config.bucket_bytes, precision
        )
        self.precision_plugin.zero_loss_scaler = self._engine.scaler
        self._buffers_due = True
        self.optimizers = [self._engine.shard_optimizer(optimizer) for optimizer in self.optimizers]

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Offloaded, stage 3's host step uses torch's fused CPU kernels (stages 1 and 2 choose them in the engine),
        and disk-offloaded state created or replaced by the step moves into its files. The first step of a ``fit``
        is followed by the memory report."""
        kernels: AbstractContextManager[None] = nullcontext()
        if self.config.offload is not OffloadTarget.DEVICE and self._sharded is not None:
            inner = unwrap(optimizer)
            # decided at the first step, once the shards are where they stay (the groups are looked up each step:
            # loading a checkpoint replaces them)
            if id(inner) not in self._host_kernels:
                self._host_kernels[id(inner)] = host_kernel(inner)
            kernel = self._host_kernels[id(inner)]
            kernels = implementation(unchosen_groups(inner.param_groups, kernel), kernel)
        with kernels:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._disk is not None:
            self._disk.adopt(unwrap(optimizer))
        if self._report_due:
            self._report_due = False
            self._log_memory_report()
        return output

    def _log_memory_report(self) -> None:
        """Rank 0's model state beside the estimate; other ranks measure nothing (no collective is involved)."""
        if not self.is_global_zero:
            return
        assert self.lightning_module is not None
        report = memory_report(
            self.lightning_module,
            self.optimizers,
            strategy=f"zero{int(self.stage)}",
            num_ranks=self.world_size,
            num_nodes=self.num_nodes,
            master_weights=self.config.master_weights,
            engine=self._engine,
            offload=self.config.offload is not OffloadTarget.DEVICE,
        )
        log_info(report)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches before the last of an accumulation window: stage 1 accumulates locally; stage 2 keeps
        reducing each backward into its gradient shards, so full gradients never accumulate; stage 3 uses
        ``fully_shard``'s no-sync: each unit keeps its full gradient until the synchronised backward."""
        if self._sharded is not None:
            with self._sharded.gradient_sync_disabled():
                yield None
            return
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
        context = self.precision_plugin.train_step_context
        return self._step("training_step", super().training_step, context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        context = self.precision_plugin.val_step_context
        return self._step("validation_step", super().validation_step, context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        context = self.precision_plugin.test_step_context
        return self._step("test_step", super().test_step, context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.predict_step_context
        return self._step("predict_step", super().predict_step, context, *args, **kwargs)

    def _step(
        self,
        hook: str,
        unsharded: Callable[..., Any],
        context: Callable[[], AbstractContextManager],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """One training, validation, test or predict step: buffers synchronised as DDP would, then the step, run as
        the root unit's forward under stage 3."""
        self._sync_buffers_before_forward()
        if self._sharded is None:
            return unsharded(*args, **kwargs)
        with context():
            return self._sharded.step(self._forward_redirection, hook, *args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        if self._sharded is not None:
            check_plain_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._sharded is not None and self._sharded.gradient_sync:
            self._sharded.reduce_replicated_grads()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._check_even_batches("validation")

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._check_even_batches("test")

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._check_even_batches("predict")

    def _check_even_batches(self, loop: str) -> None:
        if self._sharded is not None:
            assert self.lightning_module is not None
            check_even_batches(self.lightning_module.trainer, loop, self._sharded.group)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._at_rest()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._at_rest()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._at_rest()

    def _at_rest(self) -> None:
        """Stage 3: free the root unit's gathered parameters; the module then holds exactly what the optimizer
        updates (which checkpoints name) and no more."""
        if self._sharded is not None:
            self._sharded.reshard()

    def _sync_buffers_before_forward(self) -> None:
        """Broadcast rank 0's buffers when the previous step was a synchronised training step, DDP's exact rule:
        so BatchNorm statistics evolve as they would under ``"ddp"``."""
        engine = self._engine
        if not self.config.broadcast_buffers:
            return
        if self._sharded is not None:
            group, synchronised = self._sharded.group, self._sharded.gradient_sync
        elif engine is not None and engine.state is EngineState.ATTACHED:
            group, synchronised = engine.group, engine.reducer.mode is ReduceMode.SYNC
        else:
            return
        if self._buffers_due:
            assert self.lightning_module is not None
            with torch.no_grad():
                comm.broadcast_(list(self.lightning_module.buffers()), group)
        self._buffers_due = torch.is_grad_enabled() and synchronised

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a sharded checkpoint loads into the shards, which exist only after setup

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        self._at_rest()
        return sharded_model_state(self.lightning_module, self._engine)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        self._at_rest()
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
        save_directory(checkpoint, self.lightning_module, path)

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
        directory = readable_directory(path)
        if directory is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        self._at_rest()
        return load_directory(directory, self.lightning_module, self._engine, optimizers, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:  # absent when a checkpoint directory was loaded in place
            return
        if self._sharded is not None:  # an ordinary file: each rank keeps its rows of every whole tensor
            self._sharded.load_full_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)
            if self._engine is not None:
                self._engine.masters_from_module()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if not states:  # a checkpoint directory was loaded in place
            return
        for optimizer, state in zip(self.optimizers, states, strict=True):
            if isinstance(optimizer, ZeroOptimizer):
                load_full_optimizer_state(optimizer, state)
            elif self._sharded is not None:
                load_full_optimizer_state_into_dtensors(optimizer, state)
            else:
                optimizer.load_state_dict(state)
            if self.config.offload is OffloadTarget.DEVICE:  # offloaded state stays where the loaders put it
                _optimizer_to_device(optimizer, self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Stage 3 on several ranks: parameters of modules with ``reset_parameters()`` are created on the meta
        device, and get their values after sharding (see :mod:`lightning_zero._meta_init`), unless
        ``empty_init=False`` asks for eager initialization."""
        with super().tensor_init_context(empty_init), self._parameters_on_meta(empty_init is not False):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: stage 3 creates parameters on the meta device (see ``tensor_init_context``)."""
        with super().model_sharded_context(), self._parameters_on_meta(True):
            yield

    def _parameters_on_meta(self, enabled: bool) -> AbstractContextManager[None]:
        several = self.num_nodes * self.num_processes > 1
        if enabled and self.stage is Stage.PARAMETERS and (several or self.config.offload is not OffloadTarget.DEVICE):
            return self._meta_init()
        return nullcontext()

    @override
    def teardown(self) -> None:
        # Detached, not dropped: a checkpoint saved after `fit` still writes each rank's shards only.
        if self._engine is not None:
            self._engine.detach()
        if self._sharded is not None:
            # Stage 3 keeps SyncBatchNorm after `fit`: `fully_shard` manages those layers' parameters, and swapping
            # the layers back to BatchNorm would leave the parameters on modules it no longer sees.
            self._layer_sync = None
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        super().teardown()

    def _remove_engine(self) -> None:
        if self._engine is not None:
            self._engine.detach()
            self._engine = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for strategy in (Zero1Strategy, Zero2Strategy, Zero3Strategy):
            stage = int(strategy.default_stage)
            strategy_registry.register(
                f"zero{stage}",
                strategy,
                description=f"ZeRO stage {stage}: {strategy.__doc__.splitlines()[0]}",
                override=True,
            )
        offloaded = {"offload_optimizer": True}
        for name, strategy, options, where in (
            ("zero2_offload", Zero2Strategy, offloaded, "optimizer state and step"),
            ("zero3_offload", Zero3Strategy, {**offloaded, "offload_parameters": True}, "shards, optimizer and step"),
        ):
            description = f"ZeRO stage {int(strategy.default_stage)} with {where} in host memory"
            strategy_registry.register(name, strategy, description=description, override=True, **options)


class Zero1Strategy(ZeroStrategy):
    """Shards optimizer state; every rank keeps full parameters and full averaged gradients."""

    default_stage = Stage.OPTIMIZER


class Zero2Strategy(ZeroStrategy):
    """Shards optimizer state and gradients; full gradients are freed as soon as their bucket is reduced."""

    default_stage = Stage.GRADIENTS


class Zero3Strategy(ZeroStrategy):
    """Shards optimizer state, gradients and parameters; each unit's parameters are gathered only around its use."""

    default_stage = Stage.PARAMETERS
