"""Offload: the optimizer's side of training kept in host memory, or its state on disk, when device memory is short.

Vocabulary:

- **host**: CPU memory. With a CUDA module it is pinned (page-locked), so copies to and from the device run
  asynchronously at full bus speed.
- **master**: the optimizer's copy of this rank's shard of a parameter (see :class:`ShardedParam`). Offloaded, the
  masters, a host copy of each reduced gradient shard and the optimizer state live on the host, and the optimizer
  steps there; only the updated shard travels back to the device.
- **disk state**: optimizer state tensors backed by memory-mapped files in the offload directory. Each file's space
  is reserved when it is created, so a full disk fails there, with an error naming the directory, and never in a
  later write-back; after every step the pages are dropped from the process, so resident memory holds the state
  only while a step touches it. The files have no names (see :mod:`lightning_zero._files`): the kernel frees them
  when the process ends, however it ends, so even a killed run leaves nothing in the directory.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Generator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero._files import nameless_file, nameless_mapping


class OffloadError(RuntimeError):
    """The offload directory cannot hold what it must."""


class OffloadTarget(Enum):
    """Where the optimizer's state and step live."""

    DEVICE = "device"  # with the parameters: no offload
    CPU = "cpu"  # masters, gradient copies, optimizer state and the step in host memory
    DISK = "disk"  # as CPU, with the optimizer state in memory-mapped files under the offload directory


def check_directory(option: str, directory: Path) -> Path:
    """``directory`` must exist and take new files, or training would fail (or lose state) later."""
    if directory.exists() and not directory.is_dir():
        raise OffloadError(
            f"`{option}={str(directory)!r}` is a file, not a directory. HINT: point `{option}` at a directory on a"
            f" local disk with room for the optimizer state, such as `{directory.parent}` (the file's own)."
        )
    if not directory.is_dir():
        raise OffloadError(
            f"`{option}={str(directory)!r}` is not an existing directory. HINT: create it (`mkdir -p {directory}`)"
            " or point it at a directory on a local disk with room for the optimizer state."
        )
    try:
        os.close(nameless_file(directory))  # as the state's files will be made
    except OSError as error:
        raise OffloadError(
            f"`{option}={str(directory)!r}` is not writable: {error.strerror}. HINT: choose a directory this process"
            " can create files in."
        ) from error
    return directory


def host_copies(tensors: list[torch.Tensor], dtype: torch.dtype | None, pin: bool) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (in ``dtype``, or each one's own), carved out of a few large allocations per dtype
    rather than one per tensor (see :func:`pinned_views` for the pinned case)."""
    copies: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(dtype or tensor.dtype, []).append(index)
    for same_dtype, indices in by_dtype.items():
        numels = [tensors[i].numel() for i in indices]
        if pin:
            parts = pinned_views(numels, same_dtype)
        else:
            parts = list(torch.empty(sum(numels), dtype=same_dtype).split(numels))
        for index, part in zip(indices, parts, strict=True):
            source = tensors[index]
            copies[index] = part.view(source.shape).copy_(source)
    return copies  # type: ignore[return-value]


def pinned_views(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Pinned 1D views of ``numels`` elements each, packed into blocks whose sizes are powers of two: the pinned
    allocator rounds every request up to one, so a single block of 4.3 GB would hold 8 GB of host memory. Largest
    first, each new block is the largest power of two the remaining elements fill (or the tensor's own, rounded up)."""
    views: list[torch.Tensor | None] = [None] * len(numels)
    remaining = sum(numels)
    blocks: list[list[Any]] = []  # [block, elements used]
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        numel = numels[index]
        block = next((b for b in blocks if b[0].numel() - b[1] >= numel), None)
        if block is None:
            size = max(1 << (remaining.bit_length() - 1), 1 << max(numel - 1, 0).bit_length())
            block = [torch.empty(size, dtype=dtype, pin_memory=True), 0]
            blocks.append(block)
        views[index] = block[0][block[1] : block[1] + numel]
        block[1] += numel
        remaining -= numel
    return views  # type: ignore[return-value]


_FUSED_ON_SHARDS = (torch.optim.Adam, torch.optim.AdamW)  # fused kernels that DTensor shards dispatch


def host_kernel(optimizer: Optimizer) -> str:
    """The implementation flag a host step sets on groups that left the choice to torch (whose default on the host
    is a loop over parameters): ``"fused"`` where the optimizer has fused CPU kernels for shards (Adam, AdamW) and
    every parameter it holds now is on the host (fused kernels want one device), else ``"foreach"``."""
    on_host = all(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
    return "fused" if isinstance(optimizer, _FUSED_ON_SHARDS) and on_host else "foreach"


def unchosen_groups(groups: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The groups that left the implementation to torch and have a ``key`` (``"foreach"`` or ``"fused"``) flag."""
    return [g for g in groups if key in g and g.get("foreach") is None and not g.get("fused")]


@contextmanager
def implementation(groups: list[dict[str, Any]], key: str) -> Generator[None, None, None]:
    """Set ``key`` on ``groups`` for the duration of a step: the same maths with faster kernels, while the groups
    as configured (and as saved) keep their settings."""
    previous = [group[key] for group in groups]
    for group in groups:
        group[key] = True
    try:
        yield
    finally:
        for group, value in zip(groups, previous, strict=True):
            group[key] = value


def backend_with_host(requested: str | None) -> str:
    """The process-group backend of a run offloading from CUDA: some collectives carry host tensors (clipping norms,
    the fp16 overflow vote), which gloo takes while NCCL takes the device ones."""
    if requested is None:
        return "cpu:gloo,cuda:nccl"
    if "gloo" not in requested:
        raise ValueError(
            f"Offloading keeps optimizer state on the host, whose collectives need a CPU backend, but"
            f" `process_group_backend={requested!r}`. HINT: pass 'cpu:gloo,cuda:nccl' or leave it unset."
        )
    return requested


def check_host_collectives() -> None:
    """Offloaded state needs collectives on host tensors; a process group made earlier in this process (by another
    strategy's run) may lack a CPU backend."""
    try:
        torch.distributed.group.WORLD._get_backend(torch.device("cpu"))
    except RuntimeError as error:
        raise RuntimeError(
            "Offloading keeps optimizer state on the host, but this process's process group, created before this run,"
            " has no CPU backend. HINT: call `torch.distributed.destroy_process_group()` before this `fit`, or start"
            " it in a fresh process; the strategy then creates one with 'cpu:gloo,cuda:nccl'."
        ) from error


class DiskState:
    """Optimizer state in memory-mapped files on ``directory``'s filesystem, one nameless file per state tensor.

    :meth:`adopt` runs after each optimizer step: state the optimizer created or a checkpoint replaced moves into new
    files; then every mapping's pages are dropped from the process. Scalars (step counters) stay in memory. A file's
    space returns to the disk once nothing maps it: when its tensor is freed, or when the process ends.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: list[mmap.mmap] = []
        self._mapped: set[int] = set()  # data_ptr of every state tensor that lives in a file
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def adopt(self, optimizer: Optimizer) -> None:
        for state in optimizer.state.values():
            for key, value in state.items():
                local = value.to_local() if isinstance(value, DTensor) else value
                if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.numel() == 0:
                    continue  # step counters stay in memory; an empty shard needs no file
                if local.data_ptr() not in self._mapped:
                    state[key] = self._to_file(value, local)
        self.release()

    def release(self) -> None:
        """Drop the mapped pages from this process; the data stays in the files (and the page cache)."""
        for mapping in self._maps:
            mapping.madvise(mmap.MADV_DONTNEED)

    def _to_file(self, value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        nbytes = local.numel() * local.element_size()
        try:
            mapping = nameless_mapping(self.directory, nbytes)
        except OSError as error:
            raise OffloadError(
                f"Could not reserve {nbytes} bytes for optimizer state in `{self.directory}`:"
                f" {error.strerror}; {self._bytes} bytes are already there. HINT: free space on that disk or point"
                " `offload_dir` at a larger one."
            ) from error
        mapped = torch.frombuffer(mapping, dtype=local.dtype, count=local.numel()).view(local.shape)
        mapped.copy_(local)
        self._maps.append(mapping)
        self._mapped.add(mapped.data_ptr())
        self._bytes += nbytes
        if not isinstance(value, DTensor):
            return mapped
        return DTensor.from_local(
            mapped, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
