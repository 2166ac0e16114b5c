"""The Trainer front end: ZeRO as ``lightning.pytorch`` strategies. Each hook translates to a call of the core's
mode (:mod:`lightning_zero._core.mode`), which does the ZeRO work for the stage and the number of ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT, LRSchedulerConfig
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero._checkpoint import publish
from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero._checkpoint.keys import SHARDED_KEYS
from lightning_zero._checkpoint.location import local_path
from lightning_zero._checkpoint.ranks import Ranks
from lightning_zero._checkpoint.source import Live, open_checkpoint
from lightning_zero._checkpoint.unpickling import Unpickling
from lightning_zero._checkpoint.whole import (
    gathered,
    parameter_shapes,
    whole_optimizer_state,
    with_records,
    write_file,
)
from lightning_zero._config import ModuleOption, Stage, StateDictType, ZeroConfig
from lightning_zero._core.checkpointed import Checkpointed
from lightning_zero._core.front_end import ZeroFrontEnd, register_names, zero_aware_plugin
from lightning_zero._deepspeed_optim import DeepSpeedOptimization
from lightning_zero._lightning_private import load_file
from lightning_zero._transport import failures
from lightning_zero._transport.stalls import as_verdict
from lightning_zero._watchdog import watchdog
from lightning_zero.pytorch.launcher import FullWeightsLauncher, ScriptLauncher
from lightning_zero.pytorch.precision import zero_aware
from lightning_zero.pytorch.preemption import DeferredRequeue, resumable


class ZeroStrategy(ZeroFrontEnd, DDPStrategy):
    """ZeRO data parallelism for any LightningModule, with no change to its code.

    Stage 1 shards optimizer state across ranks; stage 2 also shards gradients. Outside the optimizer step every
    rank holds full, current parameters, as under DDP. Stage 3 also shards the parameters (torch's ``fully_shard``):
    every rank holds only its rows of each, and a unit's parameters are gathered just for its forward and backward.
    On a single device every stage trains plainly, with no collectives, unless it offloads (or
    ``sharded_on_one_device`` asks for the sharded path, for testing).

    Args:
        stage: 1, 2 or 3. ``Zero1Strategy``, ``Zero2Strategy`` and ``Zero3Strategy`` fix it.
        bucket_cap_mb: size in MiB of the buckets gradients are reduced and parameters gathered in (stages 1, 2;
            stage 3 reduces consecutive units' gradients together up to it).
        keep_for_backward_mb: stage 3 (not offloaded), MiB of the last units' gathered parameters kept from their
            forward to their backward instead of gathered again; 0 gathers every unit twice a step.
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
        offload_parameters: stage 3, ``True`` (or ``"cpu"``): keep the parameter shards on the host, each unit brought
            to the device only while it is gathered (implies the optimizer on the host). ``"disk"`` (ZeRO-Infinity):
            keep the shards and their gradients in memory-mapped files under ``offload_dir``, each unit read ahead of
            its gather and dropped from memory after it, and the optimizer stepping one unit at a time (its state on
            disk too, unless ``offload_optimizer=True`` keeps it in host memory).
        offload_dir: the directory of ``"disk"`` offload, on a local disk with room for what goes there.
        max_in_cpu: with ``offload_parameters="disk"``, parameter elements per rank kept in host memory instead (the
            first units' shards, while they fit; DeepSpeed's ``max_in_cpu``).
        prefetch_units: with ``offload_parameters="disk"``, how many units ahead are read from disk during compute.
        page_cache: with ``"disk"`` offload, how much of the offload files the page cache may hold: ``"auto"`` (the
            default) keeps them where no memory limit below the machine's memory caps the job, and under one (a
            cgroup's, which counts the page cache) keeps what the limit leaves beside the working set, writing back
            and dropping the oldest pages beyond it; ``"keep"`` leaves them to the kernel, limit or not; ``"drop"``
            writes back and drops each range as it leaves the process; a number of bytes caps each rank's share.
        pin_memory: page-lock the host copies of a CUDA module's state (faster, asynchronous transfers).
        memory_report: log on rank 0, once per ``fit``, a table of this rank's model-state bytes (parameters,
            gradients, master weights, optimizer state) measured by walking tensors, beside the estimate of
            ``python -m lightning_zero estimate`` for the same stage, ranks and precision. It is logged right after
            the first optimizer step, the first moment at which gradients and optimizer state all exist (with several
            optimizers, only the one that stepped has state then), through Lightning's logging
            (``rank_zero_info``, logger ``lightning.pytorch``).
        shard_group_size: hybrid sharding: shard model states within groups of this many consecutive ranks
            (``"node"``: one group per node) and replicate them across groups, so that only ``1/group`` of the
            gradient bytes cross nodes and parameter gathers stay within a node. ``None``: shard across all ranks.
        quantize_weights: stage 3 (ZeRO++): gathers of parameters across hosts send int8 with a scale per 256
            elements, a quarter of fp32's bytes; the shards the optimizer steps stay exact.
        quantize_gradients: stages 2 and 3 (ZeRO++): gradients reduced within each host at full precision, then
            across hosts as int8 with error feedback (under hybrid sharding: each shard's all-reduce across groups).
        secondary_group_size: stage 3 (ZeRO++): after its forward each unit stays sharded within groups of this many
            ranks (``"node"``: a node's), so that its backward gathers within the group.
        state_dict_type: ``"sharded"`` (the default): checkpoints are directories in which each rank writes its own
            shards; ``"full"``: one ordinary checkpoint file, written by rank 0 from tensors gathered one at a time,
            which ``load_from_checkpoint`` and a plain ``Trainer`` read as they are (``FSDPStrategy``'s option).
        sharded_on_one_device: for testing, run the ZeRO machinery on a single device too (a group of one rank),
            where every stage otherwise trains plainly: it exercises the sharded code paths on that device.
        stall_after: seconds a collective may wait for its peers before every rank is asked what it is doing: ranks
            that run different code, or a peer that stopped, then fail on every rank with an error naming each rank's
            activity, on every transport, long before the process group's ``timeout``.
        deepspeed_config: a DeepSpeed config (the path of its JSON file, or a dict) whose ZeRO settings set the
            options above that are left at their defaults; see :meth:`from_deepspeed_config`. In a LightningCLI
            config: ``init_args: {deepspeed_config: ds_config.json}``.

    The other arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
    ``precision_plugin``, ``process_group_backend``, ``timeout``, ``start_method``) are those of Lightning's
    ``DDPStrategy``.
    """

    def __init__(
        self,
        stage: int | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        keep_for_backward_mb: float = 25.0,
        broadcast_buffers: bool = True,
        auto_wrap_policy: ModuleOption = None,
        activation_checkpointing: bool | ModuleOption = None,
        master_weights: bool = False,
        reduce_dtype: str | torch.dtype | None = None,
        offload_optimizer: bool | Literal["cpu", "disk"] = False,
        offload_parameters: bool | Literal["cpu", "disk"] = False,
        offload_dir: str | Path | None = None,
        max_in_cpu: int = 0,
        prefetch_units: int = 2,
        page_cache: Literal["auto", "keep", "drop"] | int = "auto",
        pin_memory: bool = True,
        memory_report: bool = True,
        shard_group_size: int | Literal["node"] | None = None,
        quantize_weights: bool = False,
        quantize_gradients: bool = False,
        secondary_group_size: int | Literal["node"] | None = None,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        sharded_on_one_device: bool = False,
        stall_after: float = 60.0,
        deepspeed_config: str | Path | dict[str, Any] | None = None,
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
        self.config = ZeroConfig.for_strategy(
            type(self).__name__,
            self.fixed_stage,
            unknown,
            peer="DDPStrategy",
            stage=stage,
            bucket_cap_mb=bucket_cap_mb,
            keep_for_backward_mb=keep_for_backward_mb,
            broadcast_buffers=broadcast_buffers,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            master_weights=master_weights,
            reduce_dtype=reduce_dtype,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            offload_dir=offload_dir,
            max_in_cpu=max_in_cpu,
            prefetch_units=prefetch_units,
            page_cache=page_cache,
            pin_memory=pin_memory,
            memory_report=memory_report,
            shard_group_size=shard_group_size,
            quantize_weights=quantize_weights,
            quantize_gradients=quantize_gradients,
            secondary_group_size=secondary_group_size,
            state_dict_type=state_dict_type,
            sharded_on_one_device=sharded_on_one_device,
            stall_after=stall_after,
            deepspeed_config=deepspeed_config,
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

    precision_plugin = zero_aware_plugin("_precision_plugin", zero_aware, Precision)
    _requeue: DeferredRequeue | None = None  # SLURM's requeue signal, acted on between steps (auto-requeue runs)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:  # notebooks: the main process gets the trained weights back, whole under every stage
            self._launcher = FullWeightsLauncher(self, start_method=self._start_method)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.mode.setup_module(self.model, self.root_device)
        self._in_run(self.mode, self.model)
        if fitting:
            self.setup_optimizers(trainer)
            self._report_due = self.config.memory_report
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """The optimizers of ``configure_optimizers`` or, where a ``deepspeed_config`` has an ``optimizer`` section,
        the one it names with its ``scheduler`` (as ``DeepSpeedStrategy`` uses them), each set up to step here."""
        sections = self.config.deepspeed_optimization
        if sections is None:
            super().setup_optimizers(trainer)
        else:
            self.optimizers, self.lr_scheduler_configs = self._from_deepspeed_config(sections)
        assert self.lightning_module is not None
        self.optimizers = self._set_up_optimizers(
            self.mode, self.lightning_module, self.optimizers, self.precision_plugin
        )

    def _from_deepspeed_config(
        self, sections: DeepSpeedOptimization
    ) -> tuple[list[Optimizer], list[LRSchedulerConfig]]:
        """The config's optimizer (stepped per optimizer step, as DeepSpeed's engine steps it) in place of
        ``configure_optimizers``; a ``scheduler`` section alone schedules the one optimizer ``configure_optimizers``
        returns without a scheduler of its own."""
        module = self.lightning_module
        assert module is not None
        if sections.optimizer_section is None:
            optimizers, configs = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or configs:
                raise ValueError(
                    f"{sections.source} has a `scheduler` section for the optimizer, and `configure_optimizers`"
                    f" returned {len(optimizers)} optimizer(s) and {len(configs)} scheduler(s). HINT: return one"
                    " optimizer and no scheduler, or drop the config's `scheduler` section."
                )
            optimizer = optimizers[0]
        else:
            if is_overridden("configure_optimizers", module, LightningModule):
                rank_zero_warn(
                    f"{sections.source} has an `optimizer` section, which takes the place of `configure_optimizers`"
                    " as under `DeepSpeedStrategy`. HINT: drop one of the two to silence this warning."
                )
            optimizer = sections.optimizer(module.parameters())
        scheduler = sections.scheduler(optimizer)
        return [optimizer], [] if scheduler is None else [LRSchedulerConfig(scheduler, interval="step")]

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The step as the mode runs it; the first step of a ``fit`` is followed by the memory report."""
        assert self.lightning_module is not None
        step = partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        return self._reported_step(self.mode, optimizer, step, self.lightning_module, self.optimizers)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.mode.no_sync():
            yield

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
        plain: Callable[..., Any],
        context: Callable[[], AbstractContextManager],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """One training, validation, test or predict step: buffers synchronised as DDP would, then the hook, called
        plainly or (stage 3) as the LightningModule's forward through Lightning's forward redirection."""
        module = self.lightning_module
        assert module is not None
        self.mode.before_step(module)

        def as_forward() -> Any:
            with context():
                return self._forward_redirection(module, module, hook, *args, **kwargs)

        return self.mode.run_step(partial(plain, *args, **kwargs), as_forward)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        self.mode.check_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self.mode.after_backward()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._requeue = DeferredRequeue.install(self._trainer())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Where a requeue signal is acted on: between two steps, on every rank at the same one (see
        :mod:`.preemption`)."""
        super().on_train_batch_start(batch, batch_idx)
        if self._requeue is not None:
            self._requeue.at_batch_start(self.root_device)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self._trainer()
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self.mode.before_evaluation(counts, "validation")

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self.mode.before_evaluation(self._trainer().num_test_batches, "test")

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.mode.before_evaluation(self._trainer().num_predict_batches, "predict")

    def _trainer(self) -> Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.mode.at_rest()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self.mode.at_rest()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self.mode.at_rest()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a sharded checkpoint loads into the shards, which exist only after setup

    def _checkpointed(self) -> Checkpointed:
        assert self.lightning_module is not None
        return Checkpointed.one(self.lightning_module, self.mode)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """``"sharded"``: every rank's entries, sharded ones as DTensors over its rows; ``"full"``: whole tensors on
        the host of rank 0 and ``{}`` on the other ranks, as ``FSDPStrategy`` returns them (collective)."""
        return self._as_configured(self._checkpointed().module_state(), gathered)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``"sharded"``: the state named by parameter, shards as DTensors; ``"full"``: on rank 0, the state dict of
        whole tensors indexed by position that ``"ddp"`` returns, ``{}`` on the other ranks (collective)."""
        return self._as_configured(self._checkpointed().optimizer_state(optimizer), whole_optimizer_state)

    def _as_configured(self, state: dict[str, Any], whole: Callable[[dict[str, Any], bool], Any]) -> dict[str, Any]:
        """``state`` as ``state_dict_type`` asks: as it is, or made whole (collective) for rank 0, ``{}`` elsewhere."""
        match self.config.state_dict_type:
            case StateDictType.SHARDED:
                return state
            case StateDictType.FULL:
                made_whole = whole(state, self.is_global_zero)
                return made_whole if self.is_global_zero else {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Every rank writes its own shards into the directory ``filepath``, published atomically when complete; with
        ``state_dict_type="full"``, rank 0 writes one ordinary file there, as ``"ddp"`` does."""
        self._refuse_storage_options(storage_options)
        assert self.lightning_module is not None
        path = self._checkpoint_path(filepath)
        match self.config.state_dict_type:
            case StateDictType.SHARDED:
                self._checkpointed().save_directory(checkpoint, path)
            case StateDictType.FULL:  # the states are whole on rank 0 already (see `lightning_module_state_dict`)
                if self.is_global_zero:
                    saves_optimizers = "optimizer_states" in checkpoint
                    named = [self._checkpointed().optimizer_state(o) for o in self.optimizers if saves_optimizers]
                    write_file(path, with_records(checkpoint, named, parameter_shapes(self.lightning_module)))
        self._checkpointed().after_save()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove the checkpoint at ``filepath``; a link there is removed, never what it points to."""
        if self.is_global_zero:
            publish.remove(local_path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A checkpoint directory loads straight into the live shards; an ordinary file loads as Lightning does, and
        a DeepSpeed checkpoint as the ordinary file it amounts to (whole tensors on every rank)."""
        path = resumable(self._checkpoint_path(checkpoint_path), self.is_global_zero)
        read_as_lightning = super().load_checkpoint
        source = open_checkpoint(
            path,
            ranks=Ranks.of_default_group(),
            unpickling=Unpickling.from_weights_only(weights_only),
            read_file=lambda file: load_file(read_as_lightning, file, weights_only),
        )
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        live = Live(
            modules={"model": self.lightning_module},
            optimizers_for=lambda _: optimizers,
            in_place=self._checkpointed(),
            take_whole=lambda whole: whole,  # Lightning's loader loads it, through `load_model_state_dict`
            # loaded in place, so the keys are checked here, as Lightning's `load_model_state_dict` would check them
            strict=self.lightning_module.strict_loading,
        )
        return source.restore(live)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:  # absent when a checkpoint directory was loaded in place
            return
        self._checkpointed().load_module_state(checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if not states:  # a checkpoint directory was loaded in place
            return
        if len(states) != len(self.optimizers):
            raise CheckpointError(
                f"The checkpoint holds the state of {len(states)} optimizer(s), and `configure_optimizers` returned"
                f" {len(self.optimizers)}. HINT: resume with the `configure_optimizers` it was saved with, or load"
                " the weights alone (`LightningModule.load_from_checkpoint`)."
            )
        records = checkpoint.get(SHARDED_KEYS) or [None] * len(states)
        for optimizer, state, recorded in zip(self.optimizers, states, records, strict=True):
            self._checkpointed().load_optimizer_state(optimizer, state, recorded)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """When stage 3 shards the module: parameters are built without memory, recording what gives them their
        values, and get those values after sharding, unless ``empty_init=False`` asks for eager construction."""
        with super().tensor_init_context(empty_init), self.mode.init_context(empty_init is not False):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: stage 3 builds parameters without memory (see ``tensor_init_context``)."""
        with super().model_sharded_context(), self.mode.init_context(True):
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Before Lightning's teardown of a failed run: the other ranks hear of the failure (see
        ``lightning_zero._transport.failures``); the mode brings the module to rest (stage 3 may have units gathered,
        which teardown could not move, and the user would see that error instead of their own; should that fail too,
        say so beside the user's exception, never instead of it); the exception notes what the other ranks
        announced."""
        super().on_exception(exception)
        failures.announce(exception)
        try:
            self.mode.settle_after_failure()
        except Exception as error:
            warnings.warn(
                f"lightning_zero could not reshard the stage-3 module after the failure above ({error!r}); moving or"
                " saving the module may fail as well. HINT: the failure above is the one to fix.",
                stacklevel=2,
            )
        failures.note_other_failures(exception)
        watchdog.note_verdict(exception)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """As ``"ddp"``'s; released by the stall watchdog, it fails with the verdict."""
        return as_verdict(partial(super().reduce, tensor, group, reduce_op))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, (Zero1Strategy, Zero2Strategy, Zero3Strategy))

    @override
    def teardown(self) -> None:
        self._end_run([self.mode])
        if self.mode.keeps_sync_batchnorm:
            self._layer_sync = None
        # Lightning's teardown moves the module to the host; inside the user's `torch.inference_mode()` that move
        # could not swap stage 3's DTensor parameters (an inference tensor has no version counter)
        with torch.inference_mode(False):
            super().teardown()


class Zero1Strategy(ZeroStrategy):
    """Shards optimizer state; every rank keeps full parameters and full averaged gradients.

    ``Trainer(strategy="zero1")`` or ``Trainer(strategy=Zero1Strategy(...))``, with the options of ``ZeroStrategy``.
    """

    fixed_stage = Stage.OPTIMIZER


class Zero2Strategy(ZeroStrategy):
    """Shards optimizer state and gradients; full gradients are freed as soon as their bucket is reduced.

    ``Trainer(strategy="zero2")``, ``"zero2_offload"`` (optimizer in host memory) or
    ``Trainer(strategy=Zero2Strategy(...))``, with the options of ``ZeroStrategy``.
    """

    fixed_stage = Stage.GRADIENTS


class Zero3Strategy(ZeroStrategy):
    """Shards optimizer state, gradients and parameters; each unit's parameters are gathered only around its use.

    ``Trainer(strategy="zero3")``, ``"zero3_offload"`` (shards and optimizer in host memory), ``"zero3_infinity"``
    (shards, gradients and optimizer state in files under the temporary directory) or
    ``Trainer(strategy=Zero3Strategy(...))``, with the options of ``ZeroStrategy``; large models build their
    layers in ``configure_model``, without memory, and get their values shard by shard.
    """

    fixed_stage = Stage.PARAMETERS
