"""What the strategies of both front ends share: the options, the mode, the process group, the memory report, and
the names they are registered under."""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import nn
from torch.optim import Optimizer

from lightning_zero._checkpoint.location import local_path
from lightning_zero._config import Stage, ZeroConfig
from lightning_zero._core import Mode, choose_mode
from lightning_zero._core.precision import take_over_scaler
from lightning_zero._core.report import log_info, memory_report
from lightning_zero._offload.placement import Placement, placement_of
from lightning_zero._transport import exit as _exit  # noqa: F401  (closes the process group before exit)
from lightning_zero._transport import watchdog

_SUPPORTED_DEVICES = ("cpu", "cuda")


class ZeroFrontEnd:
    """Placed before each front end's Lightning ``DDPStrategy`` (whose attributes it uses): the ZeRO options
    (``config``), the mode they choose, and the steps both front ends take alike."""

    fixed_stage: ClassVar[Stage | None] = None  # the stage a ``Zero{N}Strategy`` runs; ``ZeroStrategy`` takes ``stage``
    config: ZeroConfig
    _mode: Mode | None = None
    _placement: Placement | None = None
    _report_due = False  # whether the next optimizer step is the first of a run, which logs the memory report
    # given by the front end's ``DDPStrategy``
    root_device: torch.device
    num_nodes: int
    num_processes: int
    world_size: int
    is_global_zero: bool
    _process_group_backend: str | None

    @classmethod
    def from_deepspeed_config(cls, config: str | os.PathLike | Mapping[str, Any], **options: Any) -> Any:
        """The strategy a DeepSpeed config asks for: ``zero_optimization.stage``, its bucket sizes,
        ``offload_optimizer``/``offload_param`` (``device``, ``nvme_path``, ``pin_memory``) and
        ``zero_hpz_partition_size`` become this package's options, ``bf16``/``fp16`` master weights (and
        ``communication_data_type``, ``data_types.grad_accum_dtype`` the ``reduce_dtype``). One warning names the
        Trainer flags the config asks for (``precision``, ``gradient_clip_val``, ``accumulate_grad_batches``) and every
        key not acted on; quantized ZeRO++ is refused. Its ``optimizer`` and ``scheduler`` sections are built by the
        Trainer in place of ``configure_optimizers``, as ``DeepSpeedStrategy`` does (Fabric refuses them). ``options``:
        more of the strategy's arguments (an option the config sets as well must agree with it)."""
        return cls(deepspeed_config=config, **options)

    @property
    def stage(self) -> Stage:
        return self.config.stage

    @property
    def placement(self) -> Placement:
        """Where the optimizer's side of training lives (see :mod:`lightning_zero._offload.placement`), chosen once
        from the options."""
        if self._placement is None:
            self._placement = placement_of(self.config, max(self.num_processes, 1))
        return self._placement

    @property
    def mode(self) -> Mode:
        """How this run trains (see :mod:`lightning_zero._core.mode`), chosen at first use, once the number of ranks
        is known."""
        if self._mode is None:
            ranks = self.num_nodes * self.num_processes
            self._mode = choose_mode(self.config, self.placement, ranks, self.num_processes)
        return self._mode

    def _checkpoint_path(self, path: str | os.PathLike) -> Path:
        """Rank 0's checkpoint ``path``, on every rank, as a local path (see :func:`.location.local_path`)."""
        return local_path(self.broadcast(os.fspath(path)))  # type: ignore[attr-defined]

    def _refuse_storage_options(self, storage_options: Any | None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} writes sharded checkpoint directories itself and takes no `storage_options`."
                " HINT: drop `storage_options`; use `lightning_zero.consolidate_checkpoint` for a single file."
            )

    def _get_process_group_backend(self) -> str:
        backend = self.placement.process_group_backend(self._process_group_backend, self.root_device.type)
        return backend if backend is not None else super()._get_process_group_backend()  # type: ignore[misc]

    def setup_environment(self) -> None:
        device_type = self.root_device.type
        if device_type not in _SUPPORTED_DEVICES:
            raise ValueError(
                f"{type(self).__name__} runs on {' and '.join(_SUPPORTED_DEVICES)}, not on `{device_type}`."
                " HINT: pass `accelerator='cpu'` or `accelerator='gpu'`."
            )
        super().setup_environment()  # type: ignore[misc]
        self.placement.check_process_group(device_type)
        watchdog.start(self.config.stall_after)

    def _set_up_optimizers(
        self, mode: Mode, module: nn.Module, optimizers: list[Optimizer], plugin: Any
    ) -> list[Optimizer]:
        """The optimizers as ``mode`` (``module``'s) steps them, and the front end's ZeRO-aware precision ``plugin``
        told how the loss is scaled: by the mode's loss scaler where it takes the place of the plugin's
        ``GradScaler``."""
        taken = mode.replaces_grad_scaler and take_over_scaler(plugin)
        optimizers = mode.setup_optimizers(module, optimizers, grad_scaler_taken=taken)
        plugin.zero_loss_scaler = mode.loss_scaler
        return optimizers

    def _reported_step(
        self,
        mode: Mode,
        optimizer: Optimizer,
        step: Callable[[], Any],
        module: nn.Module,
        optimizers: Iterable[Optimizer],
    ) -> Any:
        """The optimizer step as ``mode`` (``module``'s) runs it; the first one of a run is followed by the memory
        report: rank 0's model state beside the estimate (other ranks measure nothing; no collective is involved)."""
        output = mode.optimizer_step(optimizer, step)
        if self._report_due:
            self._report_due = False
            if self.is_global_zero:
                report = memory_report(
                    module,
                    optimizers,
                    strategy=f"zero{int(self.stage)}",
                    num_ranks=self.world_size,
                    num_nodes=self.num_nodes,
                    master_weights=self.config.master_weights,
                    buffers=mode.buffers,
                    offload=self.placement.offloads,
                    shard_group_size=mode.shard_size,
                )
                log_info(report)
        return output


def zero_aware_plugin(attribute: str, zero_aware: Callable[[Any], Any], default: Callable[[], Any]) -> property:
    """The front end's precision plugin property, kept in ``attribute``: whatever plugin is set becomes ZeRO-aware
    (``zero_aware``), and with none set a ZeRO-aware ``default()`` is made once and kept, since the front end gives
    the plugin the mode's loss scaler."""

    def get(self: Any) -> Any:
        if getattr(self, attribute) is None:
            setattr(self, attribute, zero_aware(default()))
        return getattr(self, attribute)

    def set_(self: Any, plugin: Any) -> None:
        setattr(self, attribute, None if plugin is None else zero_aware(plugin))

    return property(get, set_)


def register_names(registry: _StrategyRegistry, classes: tuple[type, type, type]) -> None:
    """Register ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"zero2_offload"``, ``"zero3_offload"`` and
    ``"zero3_infinity"`` for a front end's ``Zero1Strategy``, ``Zero2Strategy`` and ``Zero3Strategy``."""
    for strategy in classes:
        stage = int(strategy.fixed_stage)
        summary = " ".join(inspect.getdoc(strategy).split("\n\n")[0].split())  # the docstring's first paragraph
        registry.register(f"zero{stage}", strategy, description=f"ZeRO stage {stage}: {summary}", override=True)
    _, zero2, zero3 = classes
    offloaded = {"offload_optimizer": True}
    for name, strategy, options, where in (
        ("zero2_offload", zero2, offloaded, "optimizer state and step"),
        ("zero3_offload", zero3, {**offloaded, "offload_parameters": True}, "shards, optimizer and step"),
    ):
        description = f"ZeRO stage {int(strategy.fixed_stage)} with {where} in host memory"
        registry.register(name, strategy, description=description, override=True, **options)
    # ZeRO-Infinity: shards, gradients and optimizer state in files, under the system's temporary directory unless
    # `offload_dir` says otherwise (a class with options, in a LightningCLI config too)
    infinity = {"offload_parameters": "disk", "offload_optimizer": "disk", "offload_dir": tempfile.gettempdir()}
    description = "ZeRO stage 3 with shards, gradients and optimizer state in files under the temporary directory"
    registry.register("zero3_infinity", zero3, description=description, override=True, **infinity)
