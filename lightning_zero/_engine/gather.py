"""After the optimizer step: every rank's updated shards travel to every other rank's full parameters."""

from __future__ import annotations

from collections import deque

import torch
from torch.distributed import ProcessGroup

from lightning_zero._engine.layout import RankMajorLayout
from lightning_zero._engine.pool import BufferPool
from lightning_zero._engine.sharded_param import ShardedParam
from lightning_zero._transport import collectives as comm

_IN_FLIGHT = 2  # buckets gathered concurrently: enough to overlap unpacking one with the next one's transfer


class GatherBucket:
    """Parameters whose shards are all-gathered by one collective, laid out rank-major, and the views a gather copies
    between (kept, per pooled buffer and per parameter storage: a step would otherwise make one per parameter and
    rank)."""

    def __init__(self, params: list[ShardedParam], world_size: int, rank: int) -> None:
        self.params = [s for s in params if not s.spec.replicated]  # replicated ones are updated alike everywhere
        self.layout = RankMajorLayout([s.spec for s in self.params], world_size)
        self.dtype = params[0].param.dtype
        self.device = params[0].param.device
        self.rank = rank
        self._rows: tuple[list[int], list[torch.Tensor]] = ([], [])  # params' addresses, their rows of other ranks

    def regions(self, gathered: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """In ``gathered``: this rank's region of each parameter, and every other rank's, rank by rank."""
        layout, chunks = self.layout, self.layout.chunks(gathered)
        mine = [layout.region(chunks[self.rank], i, self.rank) for i in range(len(self.params))]
        others = [
            layout.region(chunks[rank], i, rank)
            for rank in range(layout.world_size)
            if rank != self.rank
            for i in range(len(self.params))
        ]
        return mine, others

    def other_rows(self) -> list[torch.Tensor]:
        """Each parameter's rows of every other rank, in :meth:`regions`' order (made again if a parameter's
        storage moved)."""
        addresses = [s.param.data_ptr() for s in self.params]
        if addresses != self._rows[0]:
            rows = [
                s.spec.take(s.param.detach(), rank)
                for rank in range(self.layout.world_size)
                if rank != self.rank
                for s in self.params
            ]
            self._rows = (addresses, rows)
        return self._rows[1]


class ParamGatherer:
    """Rebuilds full parameters from the shards the optimizers just updated, bucket by bucket."""

    def __init__(self, buckets: list[list[ShardedParam]], group: ProcessGroup, pool: BufferPool) -> None:
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()
        self.pool = pool
        self.buckets = [GatherBucket(params, self.world_size, self.rank) for params in buckets]
        # one rank (offloading on a single device) owns every row: nothing travels
        self.buckets = [b for b in self.buckets if b.params and self.world_size > 1]

    def gather(self, only: set[int] | None = None) -> None:
        """All-gather the buckets holding a shard whose ``id`` is in ``only`` (every bucket when ``None``)."""
        todo = [b for b in self.buckets if only is None or any(id(s.shard) in only for s in b.params)]
        in_flight: deque[tuple[GatherBucket, torch.Tensor, comm.Pending]] = deque()
        for bucket in todo:
            if len(in_flight) == _IN_FLIGHT:
                self._unpack(*in_flight.popleft())
            in_flight.append(self._launch(bucket))
        while in_flight:
            self._unpack(*in_flight.popleft())

    def _launch(self, bucket: GatherBucket) -> tuple[GatherBucket, torch.Tensor, comm.Pending]:
        """This rank's shards go straight into their chunk of the output: the all-gather runs in place, with no
        buffer of their own."""
        layout = bucket.layout
        gathered = self.pool.acquire(layout.numel, bucket.dtype, bucket.device)
        mine, _ = self.pool.derived(gathered, bucket, bucket.regions)
        torch._foreach_copy_(mine, [s.local for s in bucket.params])
        chunk = layout.chunks(gathered)[self.rank]
        return bucket, gathered, comm.all_gather(gathered, chunk, self.group)

    def _unpack(self, bucket: GatherBucket, gathered: torch.Tensor, work: comm.Pending) -> None:
        work.wait()
        _, others = self.pool.derived(gathered, bucket, bucket.regions)
        torch._foreach_copy_(bucket.other_rows(), others)
        self.pool.release(gathered)
