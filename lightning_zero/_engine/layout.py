"""Where each parameter's shard lives, and how buckets lay parameters out for communication.

Vocabulary, used across the package:

- **shard**: the rows of a parameter that one rank owns, split along dim 0 with ``torch.chunk`` semantics, exactly
  as a DTensor with ``Shard(0)`` placement (and so ``fully_shard``): every rank but the last few holds
  ``ceil(dim0 / N)`` rows, trailing ranks may hold fewer or none; :class:`ShardSpec` is the one home of this rule.
  A 0-dim parameter cannot be split; it is **replicated**: every rank holds all of it and applies the same update.
- **bucket**: a run of parameters of one dtype and device whose gradients are reduced (and whose shards are
  gathered) by a single collective call.
- **natural layout**: a bucket buffer holding whole parameters back to back, as they sit in the module.
- **rank-major layout**: a bucket buffer made of N equal **chunks**, one per rank; chunk ``r`` holds rank ``r``'s
  shard of every parameter of the bucket, each padded to the same size on all ranks. One ``reduce_scatter_tensor``
  over such a buffer hands each rank exactly its shards; one ``all_gather_into_tensor`` rebuilds it.
- **presence flags**: one number per parameter at the end of a bucket (natural layout) or of every chunk
  (rank-major layout). A rank writes 1 where it produced a gradient; after the sum-reduction a flag above zero
  means some rank produced one, so a parameter unused on every rank keeps ``grad is None`` as under DDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of ``shape`` is split across ``world_size`` ranks (its derived sizes computed once: they are
    asked for every parameter of every step)."""

    shape: torch.Size
    world_size: int

    @cached_property
    def replicated(self) -> bool:
        return len(self.shape) == 0

    @cached_property
    def rows_per_rank(self) -> int:
        return 1 if self.replicated else math.ceil(self.shape[0] / self.world_size)

    @cached_property
    def padded_rows(self) -> int:
        """Dim 0 padded so that every rank holds ``rows_per_rank`` rows: what a gather of all shards carries."""
        return self.rows_per_rank * self.world_size

    @cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if not self.replicated else 1

    @cached_property
    def padded_numel(self) -> int:
        """Size of this parameter's region in each chunk of a rank-major bucket."""
        return self.rows_per_rank * self.row_numel

    def rows(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` rows of dim 0 owned by ``rank``; empty for trailing ranks of a short dim 0."""
        if self.replicated:
            return 0, 1
        start = min(rank * self.rows_per_rank, self.shape[0])
        return start, min(start + self.rows_per_rank, self.shape[0])

    def local_numel(self, rank: int) -> int:
        start, end = self.rows(rank)
        return (end - start) * self.row_numel

    def local_shape(self, rank: int) -> torch.Size:
        if self.replicated:
            return self.shape
        start, end = self.rows(rank)
        return torch.Size((end - start, *self.shape[1:]))

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """The view of ``full`` (shaped like the parameter, or longer along dim 0) that ``rank`` owns."""
        if self.replicated:
            return full
        start, end = self.rows(rank)
        return full[start:end]


class RankMajorLayout:
    """Offsets of a bucket laid out rank-major: ``world_size`` chunks of ``chunk_numel`` elements each."""

    def __init__(self, specs: list[ShardSpec], world_size: int, flagged: bool = True) -> None:
        self.specs = specs
        self.world_size = world_size
        self.offsets: list[int] = []  # start of each parameter's region inside a chunk
        offset = 0
        for spec in specs:
            self.offsets.append(offset)
            offset += spec.padded_numel
        self.flags_offset = offset
        self.chunk_numel = offset + (len(specs) if flagged else 0)  # a layout for gathers has no flags
        self.numel = self.chunk_numel * world_size

    def region(self, chunk: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """The part of ``chunk`` (one rank's chunk) holding ``rank``'s shard of parameter ``index``, shaped."""
        spec = self.specs[index]
        start = self.offsets[index]
        return chunk[start : start + spec.local_numel(rank)].view(spec.local_shape(rank))

    def chunks(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (1D, ``numel``) seen as ``(world_size, chunk_numel)``."""
        return buffer[: self.numel].view(self.world_size, self.chunk_numel)

    def flags(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk[self.flags_offset : self.chunk_numel]


class NaturalLayout:
    """Offsets of a bucket holding whole parameters back to back, followed by one presence flag each."""

    def __init__(self, shapes: list[torch.Size]) -> None:
        self.shapes = shapes
        self.offsets: list[int] = []
        offset = 0
        for shape in shapes:
            self.offsets.append(offset)
            offset += math.prod(shape)
        self.flags_offset = offset
        self.numel = offset + len(shapes)

    def region(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        start = self.offsets[index]
        shape = self.shapes[index]
        return buffer[start : start + math.prod(shape)].view(shape)

    def flags(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.flags_offset : self.numel]
