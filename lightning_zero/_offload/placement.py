"""Where the optimizer's side of training lives: the placement policy, chosen once per strategy beside the mode.

A placement owns every decision that depends on where the optimizer steps (see the vocabulary in
:mod:`lightning_zero._offload`):

- where the optimizer's **masters** live (:meth:`Placement.masters`), and the CPU mesh over the same ranks that host
  tensors of a device module need (:meth:`Placement.master_mesh`); the reduced gradient shards follow the masters;
- where **optimizer state** lives between steps (:meth:`Placement.stepping`: disk state moves into its files);
- which **kernels** a step on shards runs (:meth:`Placement.shard_kernels`, :meth:`Placement.keep_step_kernels`);
- the **process group** a run needs (:meth:`Placement.process_group_backend`, :meth:`Placement.check_process_group`):
  host tensors need a CPU backend beside NCCL;
- stage 3's ``fully_shard`` **offload policy** (:meth:`Placement.fsdp_offload_policy`), and where its shards live
  once sharded (:meth:`Placement.materializing`: in files, with ``offload_parameters="disk"``).

:class:`OnDevice` keeps everything with the parameters; :class:`OnHost` moves masters, gradient copies, optimizer
state and the step to host memory; :class:`OnDisk` does the same with the optimizer state in memory-mapped files.
Either can also keep stage 3's parameter shards and gradients in files (:class:`ParameterFiles`), and then steps the
optimizer one unit at a time.
The front ends' ``placement_of`` (:mod:`lightning_zero._core.front_end`) reads the options: where the optimizer
lives, and whether stage 3's shards go to files. Files' pages leave the process, and the page cache keeps them within
the ``page_cache`` option's budget, through one :class:`~lightning_zero._offload.writeback.Writeback` shared by the
shards' and the optimizer state's files.
A new tier (another kind of memory, a different host kernel) is a new subclass, chosen in :func:`placement_for`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.optim import Optimizer

from lightning_zero._offload.by_unit import one_unit_at_a_time
from lightning_zero._offload.disk import DiskState
from lightning_zero._offload.host import host_copies
from lightning_zero._offload.keepalives import free_after_use
from lightning_zero._offload.kernels import KernelChoice
from lightning_zero._offload.local_step import LocalStep, Views, steps_locally
from lightning_zero._offload.page_cache import PageCache, this_process_budget
from lightning_zero._offload.param_files import ParameterFiles
from lightning_zero._offload.process_group import backend_with_host, check_host_collectives
from lightning_zero._offload.target import OffloadTarget
from lightning_zero._offload.writeback import Writeback
from lightning_zero._transport.mesh import created


class Placement:
    """Where masters, gradient shards, optimizer state and the optimizer step live; the base class keeps them all on
    the device, with the parameters."""

    #: whether anything leaves the device (a single-device run then still takes the sharded path)
    offloads: bool = False

    def __init__(self, *, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory  # page-lock host tensors of a CUDA module
        # stage 3: each optimizer's kernels, and how it steps on local tensors where its update is elementwise
        self._kernels: weakref.WeakKeyDictionary[Optimizer, KernelChoice] = weakref.WeakKeyDictionary()
        self._local_steps: weakref.WeakKeyDictionary[Optimizer, LocalStep] = weakref.WeakKeyDictionary()

    # --- the process group ------------------------------------------------------------------------------------------

    def process_group_backend(self, requested: str | None, device_type: str) -> str | None:
        """The backend the front end creates the process group with; ``None``: the front end's own choice."""
        return None

    def check_process_group(self, device_type: str) -> None:
        """Once the process group exists: refuse one that cannot carry what this placement sends."""

    # --- stages 1 and 2: the engine's masters -----------------------------------------------------------------------

    def masters(self, shards: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """The optimizer's copy of each of ``shards`` (this rank's rows of the module's parameters), in ``dtype``
        (``None``: each shard's own): the shard itself where the optimizer can step on it in place."""
        if dtype is None:
            return list(shards)
        return [shard if shard.dtype == dtype else shard.to(dtype, copy=True) for shard in shards]

    def master_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The mesh of the masters' DTensors when it is not ``mesh``, the module's."""
        return None

    def shard_kernels(self, optimizer: Optimizer) -> KernelChoice:
        """The kernels a :class:`~lightning_zero._engine.optimizer.ZeroOptimizer` steps with; call it with the
        shards in the groups."""
        return KernelChoice.on_shards(optimizer, host=False)

    # --- stage 3: ``fully_shard``'s shards --------------------------------------------------------------------------

    def fsdp_offload_policy(self, device: torch.device) -> OffloadPolicy | None:
        """``fully_shard``'s offload policy; ``None``: the shards stay on the device."""
        return None

    @contextmanager
    def materializing(
        self, root: nn.Module, units: list[nn.Module], device: torch.device
    ) -> Generator[Callable[[str], None] | None, None, None]:
        """Stage 3, around giving the shards of the sharded ``root`` and ``units`` their values on ``device``: yields
        what to tell, by name, of each parameter as it gets its values (``None``: nothing); the shards are where they
        stay once it ends."""
        yield None

    def keep_step_kernels(self, optimizer: Optimizer) -> None:
        """Stage 3: decide once, with the shards where they stay, the kernels :meth:`stepping` applies to
        ``optimizer``, and whether it steps on their local tensors."""
        self._kernels[optimizer] = self.shard_kernels(optimizer)
        if steps_locally(optimizer):
            self._local_steps[optimizer] = LocalStep(self.state_views)

    #: whether views of the optimizer state may outlive a step (not where the state moves into files after it)
    state_views: Views = Views.KEPT

    # --- every step -------------------------------------------------------------------------------------------------

    @contextmanager
    def stepping(self, optimizer: Optimizer) -> Generator[None, None, None]:
        """Around the optimizer step of ``optimizer`` (the ``torch.optim`` one): the kernels kept for it, on the local
        tensors of its shards where it can (its closure still runs on the shards)."""
        with ExitStack() as stack:
            kernels = self._kernels.get(optimizer)
            if kernels is not None:
                stack.enter_context(kernels.applied(optimizer))
            local = self._local_steps.get(optimizer)
            if local is not None:
                stack.enter_context(local.around_step(optimizer))
            yield

    # --- checkpoints -------------------------------------------------------------------------------------------------

    @property
    def state_on_device(self) -> bool:
        """Whether optimizer state loaded from a checkpoint belongs on the device (else it stays where it was put)."""
        return True

    def state_like(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Memory for an optimizer state entry a checkpoint directory loads, laid out like ``like`` (a tensor the
        optimizer updates) in ``dtype``: where this placement keeps optimizer state."""
        return torch.empty_like(like, dtype=dtype)

    def release(self) -> None:
        """After a checkpoint read or wrote every shard and state tensor: the pages of those in files leave the
        process (the data stays in the files)."""

    def teardown(self) -> None:
        """After training: release what only training needs."""


class OnDevice(Placement):
    """Everything with the parameters: no offload."""


class OnHost(Placement):
    """Masters, a host copy of each reduced gradient shard, optimizer state and the step in host memory (pinned for a
    CUDA module); only the updated shards travel back to the device. With ``parameter_files``, stage 3's shards and
    gradients live in those files instead, and the optimizer steps one unit at a time."""

    offloads = True

    def __init__(self, *, pin_memory: bool = True, parameter_files: ParameterFiles | None = None) -> None:
        super().__init__(pin_memory=pin_memory)
        self.parameter_files = parameter_files

    def process_group_backend(self, requested: str | None, device_type: str) -> str | None:
        return backend_with_host(requested) if device_type == "cuda" else None

    def check_process_group(self, device_type: str) -> None:
        if device_type == "cuda":
            check_host_collectives()

    def masters(self, shards: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Host copies of every shard, even in its own dtype."""
        pin = self.pin_memory and any(t.device.type == "cuda" for t in shards)
        return host_copies(shards, dtype, pin)

    def master_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The same ranks as a CPU mesh for a device module (the process group must take host tensors:
        ``cpu:gloo,cuda:nccl``): a DTensor moves its local tensor to its mesh's device type."""
        return created(DeviceMesh.from_group(mesh.get_group(), "cpu")) if mesh.device_type != "cpu" else None

    def shard_kernels(self, optimizer: Optimizer) -> KernelChoice:
        return KernelChoice.on_shards(optimizer, host=True)

    def fsdp_offload_policy(self, device: torch.device) -> OffloadPolicy | None:
        """The shards are the optimizer's parameters: they, their gradients and the optimizer state live on the host
        (``fully_shard``'s CPU offload), and the step runs there."""
        pin = self.pin_memory and device.type == "cuda" and self.parameter_files is None  # files are not pinned
        return CPUOffloadPolicy(pin_memory=pin)

    @contextmanager
    def materializing(
        self, root: nn.Module, units: list[nn.Module], device: torch.device
    ) -> Generator[Callable[[str], None] | None, None, None]:
        """Shards in files move there unit by unit as they get their values on the host (on a GPU, once all have
        theirs and are back on the host); on the CPU, fewer copies of a unit stay alive (:mod:`.keepalives`)."""
        files = self.parameter_files
        if files is None:
            yield None
            return
        files.expect(root, units)
        yield files.filled if device.type == "cpu" else None
        files.adopt()
        if device.type == "cpu":
            free_after_use([root, *units])

    @contextmanager
    def stepping(self, optimizer: Optimizer) -> Generator[None, None, None]:
        with super().stepping(optimizer):
            if self.parameter_files is None:
                yield
            else:  # each unit's chunk is followed by its own `_after_step`
                with one_unit_at_a_time(optimizer, self.parameter_files, lambda c: self._after_step(optimizer, c)):
                    yield
                return
        self._after_step(optimizer, None)

    def _after_step(self, optimizer: Optimizer, params: list[torch.Tensor] | None) -> None:
        """After the optimizer stepped on ``params`` (``None``: all of its parameters)."""

    def release(self) -> None:
        if self.parameter_files is not None:
            self.parameter_files.release()

    @property
    def state_on_device(self) -> bool:
        return False


class OnDisk(OnHost):
    """As :class:`OnHost`, with the optimizer state in memory-mapped files under ``directory`` (see
    :class:`~lightning_zero._offload.disk.DiskState`)."""

    state_views = Views.PER_STEP

    def __init__(
        self,
        directory: Path,
        *,
        pin_memory: bool = True,
        parameter_files: ParameterFiles | None = None,
        writeback: Writeback | None = None,
    ) -> None:
        super().__init__(pin_memory=pin_memory, parameter_files=parameter_files)
        self.directory = directory
        self.writeback = writeback or Writeback(this_process_budget(PageCache.AUTO))
        self._disk: DiskState | None = None  # the files of this run's optimizer state, from the first setup on

    def _after_step(self, optimizer: Optimizer, params: list[torch.Tensor] | None) -> None:
        """State the step created or a checkpoint replaced moves into its files."""
        self._files().adopt(optimizer, params)
        if params is None:  # the whole step (with parameter files, their chunks tell when it ends)
            self.writeback.step_ended()

    def state_like(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """In a new file: a resume loads the state straight into its files, never all of it into memory."""
        return self._files().empty_like(like, dtype)

    def release(self) -> None:
        super().release()
        if self._disk is not None:
            self._disk.release()

    def _files(self) -> DiskState:
        if self._disk is None:
            self._disk = DiskState(self.directory, self.writeback)
        return self._disk

    def teardown(self) -> None:
        self._disk = None  # its files go with the last tensor mapping them


def placement_for(
    target: OffloadTarget,
    *,
    offload_dir: Path | None,
    pin_memory: bool,
    parameter_files: ParameterFiles | None = None,
    writeback: Writeback | None = None,
) -> Placement:
    """The placement of an offload target (of the optimizer), with stage 3's ``parameter_files`` if the shards live
    on disk; disk state's files leave through ``writeback`` (by default one of its own)."""
    match target:
        case OffloadTarget.DEVICE:
            assert parameter_files is None  # parameters on disk take the optimizer to the host
            return OnDevice(pin_memory=pin_memory)
        case OffloadTarget.CPU:
            return OnHost(pin_memory=pin_memory, parameter_files=parameter_files)
        case OffloadTarget.DISK:
            assert offload_dir is not None  # the options require it
            return OnDisk(offload_dir, pin_memory=pin_memory, parameter_files=parameter_files, writeback=writeback)
    raise ValueError(f"No placement for {target}.")
