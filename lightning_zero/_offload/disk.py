"""Optimizer state in memory-mapped files under the offload directory (``offload_optimizer="disk"``)."""


from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero._files import nameless_mapping
from lightning_zero._offload.target import OffloadError
from lightning_zero._offload.writeback import MappedFile, Writeback
from lightning_zero._stage3.seam import dtensor_like


class DiskState:
    """Optimizer state in memory-mapped files on ``directory``'s filesystem, one nameless file per state tensor.

    :meth:`adopt` runs after each optimizer step: state the optimizer created or a checkpoint replaced moves into new
    files; then every mapping's pages leave the process, and the page cache keeps them within its budget
    (``writeback``, see :mod:`~lightning_zero._offload.page_cache`). A checkpoint directory loads into new files
    (:meth:`empty_like`) without passing through memory. Scalars (step counters) stay in memory. The files
    stay mapped while this object lives (state a checkpoint replaced included); their space returns to the disk once
    it and the state's tensors are dropped at teardown, or when the process ends, however it ends.
    """

    def __init__(self, directory: Path, writeback: Writeback) -> None:
        self.directory = directory
        self.writeback = writeback
        self._maps: dict[int, MappedFile] = {}  # data_ptr of every state tensor that lives in a file -> its file
        self._bytes = 0

    def adopt(self, optimizer: Optimizer, params: list[torch.Tensor] | None = None) -> None:
        """Move the state of ``params`` (``None``: all the optimizer's) into files where it is not in one, and drop
        its pages from the process."""
        states = optimizer.state.values() if params is None else [optimizer.state[p] for p in params]
        for state in states:
            for key, value in state.items():
                local = _local(value)
                if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.numel() == 0:
                    continue  # step counters stay in memory; an empty shard needs no file
                file = self._maps.get(local.data_ptr())
                if file is None:
                    state[key] = self._to_file(value, local)
                    file = self._maps[_local(state[key]).data_ptr()]
                self.writeback.leave(file, 0, len(file.mapping), written=True)

    def release(self) -> None:
        """Drop the mapped pages from this process; the data stays in the files."""
        for file in self._maps.values():
            self.writeback.leave(file, 0, len(file.mapping), written=True)
        self.writeback.drain()

    def empty_like(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A state tensor laid out like ``like`` (a DTensor: its local tensor) in ``dtype``, in a new file."""
        local = _local(like)
        if local.numel() == 0:
            return torch.empty_like(like, dtype=dtype)  # an empty shard needs no file
        return _like(like, self._new(local.shape, dtype))

    def _to_file(self, value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        mapped = self._new(local.shape, local.dtype)
        mapped.copy_(local)
        return _like(value, mapped)

    def _new(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = shape.numel()
        nbytes = numel * dtype.itemsize
        file = reserve(self.directory, nbytes, "optimizer state", f"{self._bytes} bytes")
        mapped = torch.frombuffer(file.mapping, dtype=dtype, count=numel).view(shape)
        self._maps[mapped.data_ptr()] = file
        self._bytes += nbytes
        return mapped


def _local(value: Any) -> Any:
    """A DTensor's local tensor; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the local tensor of a DTensor laid out as ``value``, or itself if ``value`` is a plain tensor; it
    stays in its file whatever the mesh's device (stage 3 offloaded from a GPU keeps host shards on a CUDA mesh)."""
    return dtensor_like(value, local) if isinstance(value, DTensor) else local


def reserve(directory: Path, nbytes: int, what: str, held: str) -> MappedFile:
    """A new nameless file of ``nbytes`` for ``what`` under ``directory``, mapped; a disk without room is an
    :class:`OffloadError` naming the directory and what is ``held`` there already."""
    try:
        return MappedFile(*nameless_mapping(directory, nbytes))
    except OSError as error:
        raise OffloadError(
            f"Could not reserve {nbytes} bytes for {what} in `{directory}`: {error.strerror}; {held} are already"
            " there. HINT: free space on that disk or point `offload_dir` at a larger one."
        ) from error
