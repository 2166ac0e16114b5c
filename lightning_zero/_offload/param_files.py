"""Stage 3's parameter shards and their gradients in memory-mapped files (``offload_parameters="disk"``,
ZeRO-Infinity).

From the root's first forward on, each unit's shards on this rank live in one nameless file under the offload
directory, mapped shared, one page-aligned region per parameter; its gradient shards in a second file, made at its
first backward. The process holds a file's pages only while it works on them, and the kernel reads them ahead and
writes them back:

- before a unit's forward, the next ``prefetch`` units in the root's module order (taken as the order of the
  forward) are read ahead (``MADV_WILLNEED``: the kernel
  reads them while this unit computes); after its forward, its pages leave the process (``MADV_DONTNEED``; a shared
  mapping keeps their data in the file);
- as a unit's gradient shards arrive in backward (``fully_shard`` calls the parameter's post-accumulate-grad hooks),
  each is copied into its file, becomes the parameter's ``.grad``, and both leave the process; the units next in
  backward order are read ahead;
- the optimizer steps one unit at a time (:meth:`ParameterFiles.chunks`), each unit's pages read ahead of its turn and
  dropped after it.

The first units in order whose shards fit in ``max_in_cpu`` elements stay in host memory as ``fully_shard`` left them.
The files have no names, so nothing of them outlives the process, however it ends (:mod:`lightning_zero._files`).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_zero._offload.disk import reserve
from lightning_zero._transport.torch_private import move_shard, padded_shard, shard_grad, unit_shards

PAGE = mmap.PAGESIZE


def _page_multiple(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass
class Region:
    """One parameter's place in its unit's files: the byte range of its padded shard (and of its gradient)."""

    shard: Any  # the ``FSDPParam``
    offset: int
    nbytes: int
    grad: torch.Tensor | None = None  # its gradient's view of the unit's gradient file, from its first backward


@dataclass(eq=False)
class UnitFiles:
    """A unit's shards in one file, and their gradients in another."""

    name: str
    regions: list[Region]
    nbytes: int
    index: int = -1  # its place in :attr:`ParameterFiles.units`
    shards: mmap.mmap | None = None
    grads: mmap.mmap | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's parameters in its files, in the files' order."""
        return [region.shard.sharded_param for region in self.regions]

    def advise(self, advice: int, region: Region | None = None) -> None:
        """``madvise`` the unit's pages (or one region's), shards and gradients alike."""
        start, length = (0, self.nbytes) if region is None else (region.offset, _page_multiple(region.nbytes))
        for mapping in (self.shards, self.grads):
            if mapping is not None and length:
                mapping.madvise(advice, start, length)


class ParameterFiles:
    """The shards of a ``fully_shard``-ed module's units in files under ``directory`` (see the module)."""

    def __init__(self, directory: Path, max_in_cpu: int, prefetch: int) -> None:
        self.directory = directory
        self.max_in_cpu = max_in_cpu
        self.prefetch = prefetch
        self.units: list[UnitFiles] = []  # in the root's module order, taken for the forward order
        self._of_param: dict[int, UnitFiles] = {}  # id(parameter) -> its unit
        self._in_backward: set[int] = set()  # id() of each unit whose gradients arrived in the backward under way
        self._bytes = 0

    # --- setting up -------------------------------------------------------------------------------------------------

    def adopt(self, root: nn.Module, units: list[nn.Module]) -> None:
        """At the start of ``root``'s first forward, move the shards of ``units`` and of ``root`` into files and hook
        their forwards and gradients (see :meth:`_move`)."""
        handle = None

        def first_forward(*_: Any) -> None:
            assert handle is not None
            handle.remove()
            self._move(root, units)

        # after `fully_shard`'s own pre-forward hook, whose lazy set-up re-pads each shard (torch 2.8 copies an
        # unevenly sharded one into new memory there, which would take it out of its file)
        handle = root.register_forward_pre_hook(first_forward)

    def _move(self, root: nn.Module, units: list[nn.Module]) -> None:
        """Move the shards of ``units`` and ``root`` into files; ``max_in_cpu`` elements of the first units in
        ``root``'s module order stay in memory."""
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
            files = self._to_files(paths[unit] or "<root>", shards)
            if files is None:
                continue
            files.index = len(self.units)
            self.units.append(files)
            unit.register_forward_pre_hook(lambda *_, f=files: self._before_forward(f), prepend=True)
            unit.register_forward_hook(lambda *_, f=files: f.advise(mmap.MADV_DONTNEED))
        root.register_forward_pre_hook(lambda *_: self._in_backward.clear())  # a new step

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
            mapped = self._view(files.shards, region, source.dtype, source.numel()).copy_(source)
            move_shard(region.shard, mapped)
            param = region.shard.sharded_param
            self._of_param[id(param)] = files
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p, f=files, r=region: self._grad_arrived(f, r, p))
        files.advise(mmap.MADV_DONTNEED)
        return files

    def _map(self, nbytes: int, what: str) -> mmap.mmap:
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
            ahead.advise(mmap.MADV_WILLNEED)

    def _grad_arrived(self, files: UnitFiles, region: Region, param: torch.Tensor) -> None:
        """``fully_shard`` set (or accumulated into) ``param.grad``: keep it in the unit's gradient file."""
        if id(files) not in self._in_backward:  # the unit's first gradient of this backward: read the next ones
            self._in_backward.add(id(files))
            for ahead in self.units[max(files.index - self.prefetch, 0) : files.index]:
                ahead.advise(mmap.MADV_WILLNEED)
        grad = param.grad
        assert isinstance(grad, DTensor)
        local = grad.to_local()
        if local.numel() == 0:  # this rank holds no rows of it (nor a gradient file region)
            files.advise(mmap.MADV_DONTNEED, region)
            return
        if local.numel() * local.element_size() > region.nbytes:
            raise RuntimeError(
                f"The gradient of a parameter of unit `{files.name}` ({local.dtype}, {tuple(local.shape)}) does not fit"
                " the place its shard has in the gradient file."
            )
        if region.grad is None:
            if files.grads is None:
                files.grads = self._map(files.nbytes, "gradient shards")
            region.grad = self._view(files.grads, region, local.dtype, local.numel()).view(local.shape)
        if local.data_ptr() != region.grad.data_ptr():
            with torch.no_grad():
                region.grad.copy_(local)
            param.grad = shard_grad(region.shard, region.grad)
        files.advise(mmap.MADV_DONTNEED, region)

    def release(self) -> None:
        """Drop every unit's pages from the process (after a checkpoint read them all); the data stays in the files."""
        for files in self.units:
            files.advise(mmap.MADV_DONTNEED)

    # --- the optimizer step -----------------------------------------------------------------------------------------

    def chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """``params`` (an optimizer's) one unit at a time in forward order, each read ahead of its turn and dropped
        after it; those in no file (kept in memory) come last."""
        wanted = {id(p) for p in params}
        chunks = [[p for p in files.params if id(p) in wanted] for files in self.units]
        for index, (files, chunk) in enumerate(zip(self.units, chunks, strict=True)):
            for ahead in self.units[index + 1 : index + 1 + self.prefetch]:
                ahead.advise(mmap.MADV_WILLNEED)
            if chunk:
                yield chunk
            files.advise(mmap.MADV_DONTNEED)
        rest = [p for p in params if id(p) not in self._of_param]
        if rest:
            yield rest
