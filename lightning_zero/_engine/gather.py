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
    """Parameters whose shards are all-gathered by one collective, laid out rank-major."""

    def __init__(self, params: list[ShardedParam], world_size: int) -> None:
        self.params = [s for s in params if not s.spec.replicated]  # replicated ones are updated alike everywhere
        self.layout = RankMajorLayout([s.spec for s in self.params], world_size)
        self.dtype = params[0].param.dtype
        self.device = params[0].param.device


class ParamGatherer:
    """Rebuilds full parameters from the shards the optimizers just updated, bucket by bucket."""

    def __init__(self, buckets: list[list[ShardedParam]], group: ProcessGroup, pool: BufferPool) -> None:
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()
        self.pool = pool
        self.buckets = [GatherBucket(params, self.world_size) for params in buckets]
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
        chunk = layout.chunks(gathered)[self.rank]
        torch._foreach_copy_(
            [layout.region(chunk, i, self.rank) for i in range(len(bucket.params))],
            [s.local for s in bucket.params],
        )
        return bucket, gathered, comm.all_gather(gathered, chunk, self.group)

    def _unpack(self, bucket: GatherBucket, gathered: torch.Tensor, work: comm.Pending) -> None:
        work.wait()
        layout = bucket.layout
        chunks = layout.chunks(gathered)
        targets, sources = [], []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            for index, sharded in enumerate(bucket.params):
                targets.append(sharded.spec.take(sharded.param.detach(), rank))
                sources.append(layout.region(chunks[rank], index, rank))
        torch._foreach_copy_(targets, sources)
        self.pool.release(gathered)
