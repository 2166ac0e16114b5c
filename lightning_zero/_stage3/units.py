"""A stage-3 unit's parameters on the package's engine: this rank's rows of each kept, the whole of each only while
the unit runs.

Vocabulary (see also :mod:`lightning_zero._engine.layout`, whose shards, chunks and rank-major layout this uses):

- **unit**: a module the wrap policy picked (:mod:`lightning_zero._wrap`), or the root; each parameter belongs to the
  first unit, deepest first, whose subtree holds it, so a tied parameter belongs to one unit.
- **part**: the unit's parameters of one dtype; each part is gathered by one collective.
- **rows**: a part's persistent storage, this rank's chunk of its rank-major layout, in the dtype the optimizer
  steps in (fp32 masters with ``master_weights``). Each parameter's shard, a DTensor the module holds at rest and
  the optimizer updates, is a view of it.
- **whole**: a part's parameters gathered, each contiguous, in the module's dtype: what the unit's modules hold
  while it runs, and what autograd saves for its backward. Its memory is given back when the unit is released (the
  tensors stay, empty) and taken again at the next gather, so what autograd saved sees the values again.
- **gathered** / **released**: the unit's state (:class:`UnitState`).

One gather: this rank's rows are cast, if need be, into its chunk of a pooled buffer, which one all-gather fills
with every rank's chunk; one copy then lays each parameter out whole. A release is a free of the whole storage.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_zero._engine.layout import RankMajorLayout, ShardSpec
from lightning_zero._engine.pool import BufferPool
from lightning_zero._engine.sharded_param import ShardedParam
from lightning_zero._grouping import group_by
from lightning_zero._transport import collectives as comm
from lightning_zero._transport import quantized, shared_memory
from lightning_zero._transport.mesh import Split


class UnitState(Enum):
    """Whether a unit's modules hold its parameters whole."""

    RELEASED = auto()  # only this rank's rows in memory; the modules hold the shards (DTensors)
    GATHERED = auto()  # every rank's rows laid out whole; the modules hold them while the unit runs


class Part:
    """The unit's parameters of one dtype: their rows, and their whole tensors while gathered."""

    def __init__(
        self,
        params: list[nn.Parameter],
        store_dtype: torch.dtype,
        group: ProcessGroup,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        self.world_size, self.rank = group.size(), group.rank()
        self.dtype = params[0].dtype  # of the whole tensors, and of the all-gather
        self.device = device
        self.specs = [ShardSpec(p.shape, self.world_size) for p in params]
        self.layout = RankMajorLayout(self.specs, self.world_size, flagged=False)
        self.rows = torch.zeros(self.layout.chunk_numel, dtype=store_dtype, device=device)  # 1D: my chunk
        # each parameter whole, padded to every rank's rows, back to back: 1D, made at the first gather
        self._whole_offsets = [0]
        for spec in self.specs:
            self._whole_offsets.append(self._whole_offsets[-1] + spec.padded_rows * spec.row_numel)
        self._whole: torch.Tensor | None = None
        self.secondary: torch.Tensor | None = None  # this rank's piece of the gathered unit, kept for its backward
        self.whole_bytes = self._whole_offsets[-1] * self.dtype.itemsize
        self._sizes = [spec.padded_numel for spec in self.specs]
        self._outs: list[torch.Tensor] = []  # where a gather lays each parameter out (see ``take``)
        self._outs_flat = torch.empty(0)  # all of them, 1D
        self._shapes = [p.shape for p in params]
        # the whole parameters, empty until the first gather gives them their storage
        self.sharded = [
            ShardedParam(
                nn.Parameter(torch.empty(0, dtype=self.dtype, device=device), requires_grad=p.requires_grad),
                spec,
                mesh,
                local=self.layout.region(self.rows, i, self.rank),
            )
            for i, (p, spec) in enumerate(zip(params, self.specs, strict=True))
        ]

    def load_rows(self, params: list[nn.Parameter]) -> None:
        """This rank's rows of ``params`` (the module's, whole), those that have values (not meta ones)."""
        with torch.no_grad():
            for sharded, param in zip(self.sharded, params, strict=True):
                if not param.is_meta:
                    sharded.local.copy_(sharded.spec.take(param.detach(), self.rank))

    def fill_whole(self, gathered: torch.Tensor) -> None:
        """Lay out ``gathered`` (every rank's chunk, rank-major) as whole parameters."""
        if self.world_size == 1:  # one chunk, laid out as the whole tensors are: one copy
            self._outs_flat.copy_(gathered[: self.layout.flags_offset])
            return
        chunks = self.layout.chunks(gathered)[:, : self.layout.flags_offset]
        torch.split_with_sizes_copy(chunks, self._sizes, dim=1, out=self._outs)

    def take(self) -> None:
        """Memory for the whole tensors, before they are filled; at the first gather, the tensors themselves."""
        if self._whole is None:
            self._whole = torch.empty(self._whole_offsets[-1], dtype=self.dtype, device=self.device)
            # views of ``whole.data``: their writes leave the version counter that autograd checks its saved tensors
            # by untouched (a gather for backward writes the values they had in forward)
            writable = self._whole.data
            offsets = zip(self._whole_offsets[:-1], self._whole_offsets[1:], self._sizes, strict=True)
            self._outs = [writable[start:end].view(self.world_size, size) for start, end, size in offsets]
            self._outs_flat = writable
            for sharded, start, shape in zip(self.sharded, self._whole_offsets, self._shapes, strict=False):
                sharded.param.data = self._whole[start : start + shape.numel()].view(shape)
            return
        storage = self._whole.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.whole_bytes)

    def free(self) -> None:
        if self._whole is not None:
            self._whole.untyped_storage().resize_(0)


class Unit:
    """One unit: its parts, where its parameters are registered, and whether it is gathered."""

    def __init__(
        self,
        path: str,
        module: nn.Module,
        params: list[nn.Parameter],
        store_dtype: dict[torch.dtype, torch.dtype],
        group: ProcessGroup,
        mesh: DeviceMesh,
        device: torch.device,
        label: int,
        quantize: bool = False,
        secondary: Split | None = None,
    ) -> None:
        """``quantize``: its gathers send int8 (ZeRO++'s quantized weights); ``secondary``: the part of the shard group
        (a node's ranks) that keeps it sharded from its forward to its backward, which then gathers within the part
        (ZeRO++'s secondary partition)."""
        self.path = path
        self.group = group
        self.label = label  # of its all-gather (:mod:`lightning_zero._transport.labels`)
        self.quantize = quantize
        self.secondary = secondary
        by_dtype = group_by(params, lambda p: p.dtype)
        self.parts = [Part(ps, store_dtype.get(d, d), group, mesh, device) for d, ps in by_dtype.items()]
        for part, same in zip(self.parts, by_dtype.values(), strict=True):
            part.load_rows(same)
        where = {id(p): (k, i) for k, ps in enumerate(by_dtype.values()) for i, p in enumerate(ps)}
        # (owning module's parameter dict, name, shard, whole): a tie is registered twice
        self._slots: list[tuple[dict[str, nn.Parameter | None], str, nn.Parameter, nn.Parameter]] = []
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None and id(param) in where:
                    part, index = where[id(param)]
                    sharded = self.parts[part].sharded[index]
                    self._slots.append((owner._parameters, name, sharded.shard, sharded.param))
        self.state = UnitState.RELEASED
        self.forwards = 0  # forwards with gradients in this step (until its backward ends)
        self.bucket: int | None = None  # the reducer's bucket of its trained parameters, staged whole
        self.bucket_indices = range(0)  # where they are in that bucket (units may share one)
        self.whole_bytes = sum(part.whole_bytes for part in self.parts)  # its whole parameters' while gathered

    @property
    def sharded(self) -> list[ShardedParam]:
        return [s for part in self.parts for s in part.sharded]

    def hold_shards(self) -> None:
        """The modules hold the shards (at rest)."""
        for params, name, shard, _ in self._slots:
            params[name] = shard

    def hold_whole(self) -> None:
        """The modules hold the whole parameters (while the unit runs), each trained as its shard is now (a
        ``requires_grad`` changed at rest, by ``toggle_optimizer`` say)."""
        for params, name, shard, whole in self._slots:
            if whole.requires_grad != shard.requires_grad:
                whole.requires_grad_(shard.requires_grad)
            params[name] = whole

    @property
    def gathered_bytes(self) -> int:
        """The largest of its parts' all-gathers, in bytes."""
        return max((part.layout.numel * part.dtype.itemsize for part in self.parts), default=0)

    def gather(
        self, pool: BufferPool, channel: shared_memory.Channel | None = None, keep_secondary: bool = False
    ) -> None:
        """Every rank's rows, laid out whole (collective; nothing if gathered). Through a buffer of ``channel``'s
        gather ring where it has one free and large enough (every rank writes its rows into the one shared buffer,
        which every rank reads in place: no copies in and out of the channel), else through a pooled one. From the
        secondary copy where one was kept (within the part: :meth:`drop_secondary` otherwise); with
        ``keep_secondary`` (a forward whose backward comes), one is kept."""
        if self.state is UnitState.GATHERED:
            return
        for part in self.parts:
            part.take()
            if part.world_size == 1 and part.rows.dtype == part.dtype:  # one rank: its rows are the whole
                part.fill_whole(part.rows)
                continue
            self._gather_part(part, pool, channel, keep_secondary)
        self.state = UnitState.GATHERED

    def _gather_part(
        self, part: Part, pool: BufferPool, channel: shared_memory.Channel | None, keep_secondary: bool
    ) -> None:
        """One part gathered and laid out whole; every view of a ring buffer goes with this frame, freeing it."""
        plain = part.secondary is None and not self.quantize
        shared = None if channel is None or not plain else channel.gather_buffer(part.layout.numel, part.dtype)
        gathered = pool.acquire(part.layout.numel, part.dtype, part.device) if shared is None else shared
        inner = None if self.secondary is None else self.secondary.inner
        if part.secondary is not None:
            assert inner is not None
            piece = gathered.view(inner.size(), -1)[inner.rank()]
            piece.copy_(part.secondary)
            part.secondary = None
            comm.all_gather(gathered, piece, inner, self.label).wait()
        else:
            chunk = part.layout.chunks(gathered)[part.rank]
            chunk.copy_(part.rows)  # cast to the gather's dtype where the rows are masters
            if self.quantize:
                quantized.all_gather(gathered, chunk, self.group, self.label)
            else:
                comm.all_gather(gathered, chunk, self.group, self.label).wait()
            if keep_secondary and inner is not None:
                part.secondary = gathered.view(inner.size(), -1)[inner.rank()].clone()
        part.fill_whole(gathered)
        if shared is None:
            pool.release(gathered)

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            for part in self.parts:
                part.secondary = None

    def release(self) -> None:
        """The modules hold the shards; the whole tensors' memory goes back. A released unit's modules hold its shards
        already (they hold the whole parameters only once gathered): nothing to do."""
        if self.state is UnitState.RELEASED:
            return
        self.hold_shards()
        for part in self.parts:
            part.free()
        self.state = UnitState.RELEASED
