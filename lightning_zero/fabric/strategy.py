"""The Fabric front end: ZeRO as ``lightning.fabric`` strategies, for hand-written training loops.

``Fabric(strategy="zero2")`` (after ``import lightning_zero``) or ``Fabric(strategy=Zero3Strategy(...))``. Each of
Fabric's calls translates to a call of the core's mode (:mod:`lightning_zero._core.mode`), as the Trainer's hooks do,
so both front ends train alike and write the same checkpoint directories (see :mod:`lightning_zero.fabric.state`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_zero._checkpoint.ranks import Ranks
from lightning_zero._checkpoint.source import Live, Source, open_checkpoint
from lightning_zero._checkpoint.unpickling import Unpickling
from lightning_zero._checkpoint.whole import gathered_checkpoint, write_file
from lightning_zero._config import Stage, StateDictType, ZeroConfig
from lightning_zero._core import Mode, PlainMode
from lightning_zero._core.checkpointed import Checkpointed, Trained
from lightning_zero._core.front_end import ZeroFrontEnd, register_names, zero_aware_plugin
from lightning_zero._core.optimizers import as_set_up
from lightning_zero._lightning_private import load_file, set_up_together
from lightning_zero._transport.stalls import as_verdict
from lightning_zero.fabric.launcher import ScriptLauncher
from lightning_zero.fabric.precision import zero_aware
from lightning_zero.fabric.state import FabricState, as_saved, raw_module_state, without_records

_SET_BY_FABRIC = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision")


class ZeroStrategy(ZeroFrontEnd, DDPStrategy):
    """ZeRO data parallelism for a Fabric training loop.

    Stage 1 shards optimizer state across ranks; stage 2 also gradients; stage 3 also the parameters (torch's
    ``fully_shard``), each unit gathered just for its forward and backward. On a single device every stage trains
    plainly, unless it offloads.

    Args:
        stage: 1, 2 or 3. ``Zero1Strategy``, ``Zero2Strategy`` and ``Zero3Strategy`` fix it.
        options: the ZeRO options, as for the Trainer's ``lightning_zero.ZeroStrategy``: ``bucket_cap_mb``,
            ``keep_for_backward_mb``, ``broadcast_buffers``, ``auto_wrap_policy``, ``activation_checkpointing``,
            ``master_weights``, ``reduce_dtype``, ``offload_optimizer``, ``offload_parameters``, ``offload_dir``,
            ``max_in_cpu``, ``prefetch_units``, ``page_cache``, ``pin_memory``, ``memory_report``, ``shard_group_size``,
            ``quantize_weights``, ``quantize_gradients``, ``secondary_group_size``, ``state_dict_type``,
            ``sharded_on_one_device``, ``stall_after``.
        deepspeed_config: a DeepSpeed config (JSON file path or dict) setting the options it maps to; see
            :meth:`from_deepspeed_config`.

    The other arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
    ``precision``, ``process_group_backend``, ``timeout``, ``start_method``) are those of Fabric's ``DDPStrategy``.
    """

    def __init__(
        self,
        stage: int | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        deepspeed_config: str | Path | dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        # Fabric's connector sets the accelerator, devices, cluster environment, checkpoint IO and precision plugin on
        # the strategy it is given; passed here, they go to Fabric's `DDPStrategy` as they would there.
        set_by_fabric = {k: options.pop(k) for k in _SET_BY_FABRIC if k in options}
        known = ZeroConfig.option_names()
        self.config = ZeroConfig.for_strategy(
            type(self).__name__,
            self.fixed_stage,
            {k: v for k, v in options.items() if k not in known},
            peer="lightning.fabric.strategies.DDPStrategy",
            stage=stage,
            deepspeed_config=deepspeed_config,
            **{k: v for k, v in options.items() if k in known},
        )
        if self.config.deepspeed_optimization is not None:
            raise ValueError(
                f"{self.config.deepspeed_optimization.source} has an `optimizer` or `scheduler` section, and a Fabric"
                " loop builds its own. HINT: create them in your loop (DeepSpeed's `Adam` is `torch.optim.AdamW` with"
                " `weight_decay=0` unless `adam_w_mode` is false) and drop those sections."
            )
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **set_by_fabric
        )
        self._backward_sync_control = _NoSync(self)
        self._trained: list[Trained] = []  # the modules set up, in order, each with the mode that trains it
        self._optimizers: dict[int, Trained] = {}  # by the id of each optimizer as set up: the module it updates
        self._hooks: list[RemovableHandle] = []

    precision = zero_aware_plugin("_precision", zero_aware, Precision)

    @override
    def _configure_launcher(self) -> None:
        """Copies of the script: rank 0 waits for the others at its exit (:class:`ScriptLauncher`)."""
        super()._configure_launcher()
        if self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """When stage 3 shards the module: parameters are built without memory, recording what gives them their
        values, and get those values after sharding, unless ``empty_init=False`` asks for eager construction."""
        stack = ExitStack()
        stack.enter_context(super().module_init_context(empty_init))
        stack.enter_context(self.mode.init_context(empty_init is not False))
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing here: ``setup_module`` places the module as the mode trains it (stage 3 shards it first)."""

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """As ``"ddp"``'s: the total norm before clipping, a plain tensor equal on every rank. The norm of sharded
        gradients is a DTensor, which torch 2.8 leaves partial (its ``.item()`` would be this rank's part only)."""
        norm = super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Any, ...]:
        """The module, then its optimizers (built before the module was set up: stage 3 moves them to the shards);
        the scheduler too where Fabric passes one."""
        module = self.setup_module(module)
        return set_up_together(module, self._set_up(self._trained_of(module), optimizers), scheduler)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Each module set up gets its own mode (its own units under stage 3, its own buckets under stages 1 and 2),
        the first one the strategy's :attr:`mode`."""
        trained = self._trained_of(module)
        if trained is None:
            trained = Trained(module, self.mode if not self._trained else self.mode.sibling())
            self._trained.append(trained)
            self._hooks.append(module.register_forward_pre_hook(partial(_before_forward, trained.mode)))
        trained.mode.setup_module(module, self.root_device)
        self._in_run(trained.mode, module)
        self._report_due = self.config.memory_report
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Set up with the module whose parameters it updates."""
        owners = [trained for trained in self._trained if trained.mode.updates(trained.module, optimizer)]
        if len(owners) != 1:
            found = "none of them" if not owners else " and ".join(f"`{type(t.module).__name__}`" for t in owners)
            raise RuntimeError(
                f"The ZeRO strategies shard an optimizer along the parameters of one module set up before it, and"
                f" {type(optimizer).__name__} updates parameters of {found}. HINT: call `fabric.setup_module(model)`"
                " first, and build one optimizer per module from its `parameters()`."
            )
        return self._set_up(owners[0], [optimizer])[0]

    def _set_up(self, trained: Trained, optimizers: list[Optimizer]) -> list[Optimizer]:
        """``trained``'s optimizers as its mode steps them, each remembered with its module."""
        set_up = self._set_up_optimizers(trained.mode, trained.module, optimizers, self.precision)
        if len([t for t in self._trained if t.mode.loss_scaler is not None]) > 1:
            raise RuntimeError(
                f"{type(self).__name__} scales an fp16 loss with a scaler of the module's own gradient shards, and"
                " the precision plugin multiplies the loss by one scaler: one module only."
                " HINT: train several modules with `precision='bf16-mixed'` (or 32-bit), or under `zero3`."
            )
        for optimizer in set_up:
            self._optimizers[id(as_set_up(optimizer))] = trained
        return set_up

    def _trained_of(self, module: nn.Module) -> Trained | None:
        return next((trained for trained in self._trained if trained.module is module), None)

    def _trained_with(self, optimizer: Optimizer) -> Trained:
        trained = self._optimizers.get(id(as_set_up(optimizer)))
        if trained is None:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not set up by {type(self).__name__}."
                " HINT: pass it to `fabric.setup(model, optimizer)` or `fabric.setup_optimizers(optimizer)`."
            )
        return trained

    def _modes(self) -> list[Mode]:
        return [trained.mode for trained in self._trained] or [self.mode]

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's backward (the precision plugin applies the engine's loss scale), then what the mode does after
        it."""
        for mode in self._modes():
            mode.check_loss(tensor)
        super().backward(tensor, module, *args, **kwargs)
        for mode in self._modes():  # the loss may reach into several modules (a GAN's generator through its critic)
            mode.after_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step as the mode runs it; the first one is followed by the memory report."""
        trained = self._trained_with(optimizer)
        step = partial(super().optimizer_step, optimizer, **kwargs)
        return self._reported_step(trained.mode, optimizer, step, trained.module, [optimizer])

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every rank writes its own shards into the directory ``path``, published atomically when complete: the same
        directory the Trainer writes, which either front end resumes from, at any world size and stage. With
        ``state_dict_type="full"``, rank 0 writes one ordinary file there instead, as ``"ddp"`` does."""
        self._refuse_storage_options(storage_options)
        parts = FabricState.of(state)
        checkpointed = self._checkpointed(state, parts)
        checkpoint = parts.to_checkpoint(
            state,
            module_states=checkpointed.module_states(),
            combined=checkpointed.combined,
            optimizer_states=[checkpointed.optimizer_state(state[k]) for k in parts.optimizers],
            filter=filter or {},
        )
        target = self._checkpoint_path(path)
        match self.config.state_dict_type:
            case StateDictType.SHARDED:
                checkpointed.save_directory(checkpoint, target)
            case StateDictType.FULL:  # the file "ddp" writes, the entries under the user's names
                whole = gathered_checkpoint(checkpoint, checkpointed.named_like, self.is_global_zero)
                if self.is_global_zero:
                    write_file(target, as_saved(whole))
        checkpointed.after_save()

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint directory (this package's, written by either front end, or DeepSpeed's) or an ordinary
        file into the objects of ``state``, in place; return what the checkpoint holds beyond them. As under Fabric's
        ``"ddp"``, ``state`` may also be a module or an optimizer (``fabric.load_raw``: a file of its state dict
        alone), or nothing: the whole checkpoint is returned, a directory's tensors whole."""
        source = open_checkpoint(
            self._checkpoint_path(path),
            ranks=Ranks.of_default_group(),
            unpickling=Unpickling.from_weights_only(weights_only),
            read_file=lambda file: load_file(self.checkpoint_io.load_checkpoint, file, weights_only),
        )
        if isinstance(state, (nn.Module, Optimizer)):
            self._load_raw(source, state, strict)
            return {}
        if not state:  # the checkpoint as saved, less the record of its sharded entries, meant for this loader alone
            return without_records(as_saved(source.whole(progress=self.global_rank == 0)))  # a bar on a terminal
        parts = FabricState.of(state)
        if not parts.modules:
            raise TypeError(
                "The ZeRO strategies load a checkpoint into the module it was saved from, and `state` holds none."
                " HINT: pass the module set up with `fabric.setup` in `state` too."
            )
        checkpointed = self._checkpointed(state, parts)

        def take_whole(checkpoint: dict[str, Any]) -> dict[str, Any]:
            saved = as_saved(checkpoint)
            self._load_file_states(state, parts, checkpointed, saved, strict, source.path)
            return saved

        live = Live(
            modules={key: state[key] for key in parts.modules},
            optimizers_for=lambda saved: [state[k] for k in parts.saved_optimizer_order(saved, source.path)],
            in_place=checkpointed,
            take_whole=take_whole,
            strict=strict,
        )
        return parts.restore_rest(state, source.restore(live), strict)

    def _checkpointed(self, state: dict[str, Any], parts: FabricState) -> Checkpointed:
        """The modules of ``state`` with the modes that train them; a module not set up is saved and loaded whole,
        as under ``"ddp"``."""
        modules = {}
        for key in parts.modules:
            module = state[key]
            trained = self._trained_of(module)
            modules[key] = trained if trained is not None else Trained(module, PlainMode(self.config, self.placement))
        return Checkpointed(modules, lambda optimizer: self._trained_with(optimizer).mode)

    def _load_file_states(
        self,
        state: dict[str, Any],
        parts: FabricState,
        checkpointed: Checkpointed,
        checkpoint: dict[str, Any],
        strict: bool,
        source: Path,
    ) -> None:
        """Load the whole tensors of an ordinary checkpoint (read from ``source``) into the modules and optimizers of
        ``state``."""
        module_states = parts.pop_module_states(checkpoint, source)
        checkpointed.load_module_state(checkpointed.combined(module_states), strict)
        records = parts.pop_records(checkpoint)
        for key, optimizer_state in parts.pop_optimizer_states(checkpoint).items():
            checkpointed.load_optimizer_state(state[key], optimizer_state, records.get(key))

    def _load_raw(self, source: Source, target: nn.Module | Optimizer, strict: bool) -> None:
        """``fabric.load_raw``: a file of ``target``'s whole state dict, of which each rank keeps what it holds."""
        contents = source.raw()
        if isinstance(target, nn.Module):
            self.load_module_state_dict(target, raw_module_state(contents), strict)
        else:
            self._alone(self._trained_with(target).module).load_optimizer_state(target, contents)

    def _mode_of(self, module: nn.Module) -> Mode:
        trained = self._trained_of(module)
        return self.mode if trained is None else trained.mode

    def _alone(self, module: nn.Module) -> Checkpointed:
        """``module`` alone, with the mode that trains it (the first module's, for one not set up)."""
        return Checkpointed.one(module, self._mode_of(module))

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return self._alone(module).module_state()

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        self._alone(module).load_module_state(state_dict, strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """What ``optimizer.state_dict()`` gives on Fabric's optimizer: the set-up optimizer's own state dict, at rest
        (indexed by position, shards as DTensors), which its ``load_state_dict`` and torch's
        ``get_optimizer_state_dict`` take as they are."""
        self._trained_with(optimizer).mode.at_rest()
        return as_set_up(optimizer).state_dict()

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """As ``"ddp"``'s; released by the stall watchdog, it fails with the verdict."""
        return as_verdict(partial(super().all_reduce, tensor, group, reduce_op))

    @override
    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._end_run(self._modes())
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, (Zero1Strategy, Zero2Strategy, Zero3Strategy))


def _before_forward(mode: Mode, module: nn.Module, args: Any) -> None:
    mode.before_step(module)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the mode's no-sync (stage 1 accumulates locally, stage 2 keeps reducing into
    its gradient shards, stage 3 keeps each unit's full gradient until the synchronised backward)."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self._strategy._mode_of(module).no_sync() if enabled else nullcontext()


class Zero1Strategy(ZeroStrategy):
    """Shards optimizer state; every rank keeps full parameters and full averaged gradients.

    ``Fabric(strategy="zero1")``, or this class with the options of ``ZeroStrategy``: ``fabric.setup(model,
    optimizer)`` wraps the optimizer to step on this rank's shards, and ``fabric.save`` writes them alone.
    """

    fixed_stage = Stage.OPTIMIZER


class Zero2Strategy(ZeroStrategy):
    """Shards optimizer state and gradients; full gradients are freed as soon as their bucket is reduced.

    ``Fabric(strategy="zero2")`` or ``"zero2_offload"``, or this class with the options of ``ZeroStrategy``;
    ``fabric.no_backward_sync(model)`` keeps reducing into the gradient shards, so full gradients never pile up.
    """

    fixed_stage = Stage.GRADIENTS


class Zero3Strategy(ZeroStrategy):
    """Shards optimizer state, gradients and parameters; each unit's parameters are gathered only around its use.

    ``Fabric(strategy="zero3")``, ``"zero3_offload"`` or ``"zero3_infinity"``, or this class with the options of
    ``ZeroStrategy``. Under ``fabric.init_module()`` parameters are built without memory and get their values shard
    by shard.
    """

    fixed_stage = Stage.PARAMETERS
