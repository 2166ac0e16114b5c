"""Stage 3's parameter shards and their gradients in memory-mapped files (``offload_parameters="disk"``,
ZeRO-Infinity).

From set-up on, each unit's shards on this rank live in one nameless file under the offload directory, mapped
shared, one page-aligned region per parameter; its gradient shards in a second file, made at its first backward. A
model built without memory (meta parameters) gets its values unit by unit, each unit moving to its file as soon as
its parameters have theirs, so that the whole shard is never in memory at once. The process holds a file's pages
only while it works on them, and the kernel reads them ahead and writes them back:

- before a unit's forward, the next ``prefetch`` units in the root's module order (taken as the order of the
  forward) are read ahead (``MADV_WILLNEED``: the kernel reads them while this unit computes); after its forward,
  its pages leave the process (``MADV_DONTNEED``; a shared mapping keeps their data in the file), and the page cache
  keeps them within its budget (:mod:`~lightning_zero._offload.page_cache`);
- as a unit's gradient shards arrive in backward (``fully_shard`` calls the parameter's post-accumulate-grad hooks),
  each is copied into its file, becomes the parameter's ``.grad``, and both leave the process; the units next in
  backward order are read ahead;
- the optimizer steps one unit at a time (:meth:`ParameterFiles.chunks`), each unit's pages read ahead of its turn and
  dropped after it.

Pages leave through a :class:`~lightning_zero._offload.writeback.Writeback`, told which of them were written and
which are read ahead (the forward reads ahead only the shards: the gradients are written in backward).
The first units in order whose shards fit in ``max_in_cpu`` elements stay in host memory as ``fully_shard`` left them.
The files have no names, so nothing of them outlives the process, however it ends (:mod:`lightning_zero._files`).
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_zero._offload.allocator import return_large_blocks
from lightning_zero._offload.disk import reserve
from lightning_zero._offload.writeback import MappedFile, Writeback
from lightning_zero._stage3.seam import (
    move_shard,
    padded_shard,
    registered,
    settle_shards,
    shard_grad,
    shard_owner,
    sharded_param,
    unit_shards,
)

PAGE = mmap.PAGESIZE


def _page_multiple(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass
class Region:
    """One parameter's place in its unit's files: the byte range of its padded shard (and of its gradient)."""

    shard: Any  # a shard of the seam's (see `seam.unit_shards`)
    offset: int
    nbytes: int
    grad: torch.Tensor | None = None  # its gradient's view of the unit's gradient file, from its first backward


class Written(enum.Enum):
    """Which of a unit's files the process wrote since their pages last left it."""

    NOTHING = ()
    SHARDS = ("shards",)
    GRADIENTS = ("grads",)
    BOTH = ("shards", "grads")


@dataclass(eq=False)
class UnitFiles:
    """A unit's shards in one file, and their gradients in another."""

    name: str
    regions: list[Region]
    nbytes: int
    index: int = -1  # its place in :attr:`ParameterFiles.units`
    order: int = -1  # its unit's place in the root's module order
    shards: MappedFile | None = None
    grads: MappedFile | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's parameters in its files, in the files' order."""
        return [sharded_param(region.shard) for region in self.regions]

    def read_ahead(self, writeback: Writeback, *, gradients: bool) -> None:
        """Have the kernel read the unit's shards (and its gradients, with ``gradients``), while the process works on
        others, as far as the page cache's budget has room."""
        for file in (self.shards, self.grads) if gradients else (self.shards,):
            if file is not None:
                writeback.read_ahead(file, 0, self.nbytes)

    def leave(self, writeback: Writeback, written: Written, region: Region | None = None) -> None:
        """The unit's pages (or one region's), shards and gradients alike, leave the process."""
        start, length = (0, self.nbytes) if region is None else (region.offset, _page_multiple(region.nbytes))
        for name in ("shards", "grads"):
            file = getattr(self, name)
            if file is not None:
                writeback.leave(file, start, length, written=name in written.value)


@dataclass(eq=False)
class _Waiting:
    """A unit whose shards go to files once its parameters built without values (``unfilled``, by name) have them."""

    unit: FSDPModule
    name: str
    order: int
    unfilled: set[str]


def _qualified(paths: dict[nn.Module, str], module: nn.Module, name: str) -> str:
    return f"{paths[module]}.{name}" if paths[module] else name


class ParameterFiles:
    """The shards of a ``fully_shard``-ed module's units in files under ``directory`` (see the module)."""

    def __init__(self, directory: Path, max_in_cpu: int, prefetch: int, writeback: Writeback) -> None:
        return_large_blocks()  # before the module is built: else the allocator's heaps keep what building took
        self.directory = directory
        self.writeback = writeback
        self.max_in_cpu = max_in_cpu
        self.prefetch = prefetch
        self.units: list[UnitFiles] = []  # in the root's module order, taken for the forward order
        self._of_param: dict[int, UnitFiles] = {}  # id(parameter) -> its unit
        self._in_backward: set[int] = set()  # id() of each unit whose gradients arrived in the backward under way
        self._bytes = 0
        self._waiting: list[_Waiting] = []  # units to move into files, from :meth:`expect` to :meth:`adopt`
        self._waiting_for: dict[str, _Waiting] = {}  # the name of a parameter still without values -> its unit

    # --- setting up -------------------------------------------------------------------------------------------------

    def expect(self, root: nn.Module, units: list[nn.Module]) -> None:
        """Once ``root`` and its ``units`` are sharded, before their shards get their values: choose the units whose
        shards go to files (all but the first in ``root``'s module order whose shards fit in ``max_in_cpu``
        elements), each to move as soon as its parameters built without values (meta) have theirs (:meth:`filled`),
        the rest when all have (:meth:`adopt`)."""
        order = {module: index for index, module in enumerate(root.modules())}
        paths = {module: path for path, module in root.named_modules()}
        kept = 0
        for unit in sorted([*units, root], key=order.__getitem__):
            assert isinstance(unit, FSDPModule)
            shards = unit_shards(unit)
            elements = sum(padded_shard(s).numel() for s in shards)
            if kept + elements <= self.max_in_cpu:
                kept += elements
                continue
            names = {_qualified(paths, *shard_owner(s)) for s in shards if padded_shard(s).is_meta}
            waiting = _Waiting(unit, paths[unit] or "<root>", order[unit], names)
            self._waiting.append(waiting)
            self._waiting_for.update(dict.fromkeys(names, waiting))
        root.register_forward_pre_hook(lambda *_: self._in_backward.clear())  # a new step

    def filled(self, name: str) -> None:
        """The parameter at ``name`` in the root has its values now."""
        waiting = self._waiting_for.pop(name, None)
        if waiting is None:
            return
        waiting.unfilled.discard(name)
        if not waiting.unfilled:
            self._move(waiting)

    def adopt(self) -> None:
        """Every shard has its values: the units still waiting move to their files, and all take their places in
        the root's module order (taken for the forward order)."""
        for waiting in list(self._waiting):
            self._move(waiting)
        self._waiting_for.clear()
        self.units.sort(key=lambda files: files.order)
        for index, files in enumerate(self.units):
            files.index = index
            for region in files.regions:
                if not registered(region.shard):  # its file would hold a parameter the module no longer uses
                    module, name = shard_owner(region.shard)
                    raise RuntimeError(
                        f"Parameter `{name}` of {type(module).__name__} was replaced after unit `{files.name}` moved"
                        " into its file under `offload_dir`."
                    )

    def _move(self, waiting: _Waiting) -> None:
        """Move a unit's shards into its file (``fully_shard``'s lazy set-up done on them first, so that it leaves
        them there) and hook its forwards and gradients."""
        self._waiting.remove(waiting)
        unit = waiting.unit
        settle_shards(unit)
        files = self._to_files(waiting.name, unit_shards(unit))
        if files is None:
            return
        files.order = waiting.order
        self.units.append(files)
        unit.register_forward_pre_hook(lambda *_, f=files: self._before_forward(f), prepend=True)
        unit.register_forward_hook(lambda *_, f=files: f.leave(self.writeback, Written.NOTHING))

    def _to_files(self, name: str, shards: list[Any]) -> UnitFiles | None:
        regions, offset = [], 0
        for shard in shards:
            nbytes = padded_shard(shard).numel() * padded_shard(shard).element_size()
            regions.append(Region(shard, offset, nbytes))
            offset += _page_multiple(nbytes)
        if offset == 0:
            return None
        files = UnitFiles(name, regions, offset)
        files.shards = self._map(offset, "parameter shards")
        for region in regions:
            source = padded_shard(region.shard)
            mapped = self._view(files.shards.mapping, region, source.dtype, source.numel()).copy_(source)
            move_shard(region.shard, mapped)
            param = sharded_param(region.shard)
            self._of_param[id(param)] = files
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p, f=files, r=region: self._grad_arrived(f, r, p))
        files.leave(self.writeback, Written.SHARDS)
        return files

    def _map(self, nbytes: int, what: str) -> MappedFile:
        mapping = reserve(self.directory, nbytes, what, f"{self._bytes} bytes of parameter shards and gradients")
        self._bytes += nbytes
        return mapping

    @staticmethod
    def _view(mapping: mmap.mmap, region: Region, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=region.offset)

    # --- forward and backward ---------------------------------------------------------------------------------------

    def _before_forward(self, files: UnitFiles) -> None:
        """Read this unit and the next ``prefetch`` ahead."""
        for ahead in self.units[files.index : files.index + 1 + self.prefetch]:
            ahead.read_ahead(self.writeback, gradients=False)

    def _grad_arrived(self, files: UnitFiles, region: Region, param: torch.Tensor) -> None:
        """``fully_shard`` set (or accumulated into) ``param.grad``: keep it in the unit's gradient file."""
        if id(files) not in self._in_backward:  # the unit's first gradient of this backward: read the next ones
            self._in_backward.add(id(files))
            for ahead in self.units[max(files.index - self.prefetch, 0) : files.index]:
                ahead.read_ahead(self.writeback, gradients=True)
        grad = param.grad
        assert isinstance(grad, DTensor)
        local = grad.to_local()
        if local.numel() == 0:  # this rank holds no rows of it (nor a gradient file region)
            files.leave(self.writeback, Written.NOTHING, region)
            return
        if local.numel() * local.element_size() > region.nbytes:
            raise RuntimeError(
                f"The gradient of a parameter of unit `{files.name}` ({local.dtype}, {tuple(local.shape)}) does not fit"
                " the place its shard has in the gradient file."
            )
        if region.grad is None:
            if files.grads is None:
                files.grads = self._map(files.nbytes, "gradient shards")
            region.grad = self._view(files.grads.mapping, region, local.dtype, local.numel()).view(local.shape)
        if local.data_ptr() != region.grad.data_ptr():
            with torch.no_grad():
                region.grad.copy_(local)
            param.grad = shard_grad(region.shard, region.grad)
        files.leave(self.writeback, Written.GRADIENTS, region)

    def release(self) -> None:
        """Drop every unit's pages from the process (after a checkpoint read them all); the data stays in the files."""
        for files in self.units:
            files.leave(self.writeback, Written.BOTH)
        self.writeback.drain()

    # --- the optimizer step -----------------------------------------------------------------------------------------

    def chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """``params`` (an optimizer's) one unit at a time in forward order, each read ahead of its turn and dropped
        after it; those in no file (kept in memory) come last."""
        wanted = {id(p) for p in params}
        chunks = [[p for p in files.params if id(p) in wanted] for files in self.units]
        for index, (files, chunk) in enumerate(zip(self.units, chunks, strict=True)):
            for ahead in self.units[index + 1 : index + 1 + self.prefetch]:
                ahead.read_ahead(self.writeback, gradients=True)
            if chunk:
                yield chunk
            files.leave(self.writeback, Written.SHARDS)
        rest = [p for p in params if id(p) not in self._of_param]
        if rest:
            yield rest
        self.writeback.step_ended()
