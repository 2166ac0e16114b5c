"""The collective calls of the engine, each labelled for the profiler as ``lightning_zero::<name>``.

On gloo (CPU) the ranks of one host use shared memory (:mod:`.shared_memory`). Elsewhere on gloo,
reduce-scatter and all-gather are built from point-to-point messages: gloo's own reduce-scatter all-reduces the whole
buffer and keeps a chunk, moving N times the data a reduce-scatter needs, and measured 1.5 to 2.5 times slower than the
exchange below on 2 ranks (benchmarks/bench_strategies.py). NCCL keeps its collectives.

Gloo gives up on a peer after the process group's timeout; this package's errors then name the peers and what to do
(:mod:`.peers`). Each collective records what it is for (:mod:`.activity`), so that the stall watchdog
(:mod:`lightning_zero._watchdog`) can tell the ranks what each was doing long before that timeout; a failure in an
exchange asks it (:mod:`.stalls`) whether the ranks went different ways, and the error then says so.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from lightning_zero._grouping import group_by
from lightning_zero._transport import activity, labels, peers, shared_memory, stalls
from lightning_zero._transport.traffic import TRAFFIC

# torch 2.13 renamed the flat-tensor collectives; older releases know only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
MEET_TAG = 0x5A0DD07  # the tag of a meeting's messages: no exchange of this package's, nor collective, uses it


def exchange_tag(label: int) -> int:
    """The tag of a point-to-point exchange for ``label``: gloo pairs a message with the receive posted for the same
    peer and tag, so one tag per label keeps ranks that went different ways from pairing one unit's gather with
    another's reduction (which ends the process in gloo where their sizes differ, and exchanges the wrong rows where
    they do not): each waits for its own, and the stall watchdog names what each rank was doing. 31 bits, as gloo's
    tags are C ints; never :data:`MEET_TAG`."""
    tag = label & 0x7FFFFFFF
    return tag + 1 if tag == MEET_TAG else tag


def all_reduce_sum(buffer: torch.Tensor, group: ProcessGroup) -> Pending:
    TRAFFIC.record("all_reduce", buffer.nbytes, group)
    activity.entered(labels.ALL_REDUCE)
    with torch.profiler.record_function("lightning_zero::all_reduce_grads"):
        if not _point_to_point(group):
            return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        shared = _shared(buffer, group)
        if shared is not None:
            return shared.all_reduce_sum(buffer)
        with _naming_peers(group):
            return Exchange([dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)], group)


class Exchange:
    """In-flight gloo work of ``group``: point-to-point messages, or an all-reduce. ``wait`` finishes it, summing
    received chunks where it reduces; a peer that stalled or failed is named in the error."""

    def __init__(
        self,
        works: list[Work],
        group: ProcessGroup,
        finish: Callable[[], None] | None = None,
        holds: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._works = works
        self._group = group
        self._finish = finish
        self._holds = holds  # what the messages read and write, which gloo's work does not keep alive

    def wait(self) -> bool:
        with _naming_peers(self._group):
            for work in self._works:
                work.wait()
        if self._finish is not None:
            with torch.profiler.record_function("lightning_zero::sum_received_chunks"):
                self._finish()
            self._finish = None
        self._holds = ()
        return True


class Chained:
    """Collectives run one after another: the first is in flight already, each next one starts once the one before it
    is waited for (its input is that one's output)."""

    def __init__(self, first: Pending, rest: list[Callable[[], Pending]]) -> None:
        self._first = first
        self._rest = rest

    def wait(self) -> bool:
        self._first.wait()
        for start in self._rest:
            start().wait()
        self._rest = []
        return True


Pending = Work | Exchange | Chained | shared_memory.InFlight


@contextmanager
def _naming_peers(group: ProcessGroup) -> Generator[None, None, None]:
    """Gloo's errors in ``group``'s exchanges, posted or awaited, say which peers and what to do; where the ranks
    went different ways or a peer stopped (the watchdog's verdict), that error instead."""
    try:
        with peers.naming_peers("exchange over gloo", group):
            yield
    except peers.PeerError as error:
        # a lost connection or the group's own timeout says what happened already: no round (its answers could take
        # the answer window more), only a verdict a peer reached
        found = stalls.check_now(ask=not (peers.connection_lost(error) or peers.timed_out(error)))
        if found is not None:  # its release ended this exchange: gloo's own error (the cause) is only its symptom
            raise found from error.__cause__ or error
        raise


def _point_to_point(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


def _shared(tensor: torch.Tensor, group: ProcessGroup) -> shared_memory.Channel | None:
    """The shared-memory channel of ``group``, a gloo group, for ``tensor``: where its ranks share a host."""
    if tensor.device.type != "cpu" or group.size() == 1:
        return None
    return shared_memory.channel(group)


def reduce_scatter_sum(
    output: torch.Tensor, buffer: torch.Tensor, group: ProcessGroup, label: int = labels.REDUCE_SCATTER
) -> Pending:
    """``output`` (one chunk) receives the sum over ranks of this rank's chunk of ``buffer`` (``world_size`` chunks);
    ``label`` says what for (:mod:`.labels`, on shared memory)."""
    TRAFFIC.record("reduce_scatter", buffer.nbytes, group)
    activity.entered(label)
    with torch.profiler.record_function("lightning_zero::reduce_scatter_grads"):
        if not _point_to_point(group):
            return _reduce_scatter(output, buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        size, me = group.size(), group.rank()
        chunks = buffer.view(size, -1)
        if size == 1:  # one rank (offloading on a single device): nothing to exchange
            output.copy_(chunks[0])
            return Exchange([], group)
        shared = _shared(buffer, group)
        if shared is not None:
            return shared.reduce_scatter_sum(output, buffer, label)
        others = [r for r in range(size) if r != me]
        tag = exchange_tag(label)
        # The first peer's chunk lands in ``output`` itself; only ranks beyond two need extra room.
        landing = [output, *torch.empty(len(others) - 1, output.numel(), dtype=output.dtype, device=output.device)]
        ops = []
        for peer, into in zip(others, landing, strict=True):
            ops.append(dist.P2POp(dist.isend, chunks[peer], dist.get_global_rank(group, peer), group, tag))
            ops.append(dist.P2POp(dist.irecv, into, dist.get_global_rank(group, peer), group, tag))

        received = dict(zip(others, landing, strict=True))

        def finish() -> None:
            # Sum in rank order, so a replicated (0-dim) parameter gets bit-identical sums on every rank; ``output``
            # already holds rank 0's or rank 1's chunk, and two addends commute exactly.
            for rank in range(size):
                if rank != others[0]:
                    output.add_(chunks[me] if rank == me else received[rank])

        with _naming_peers(group):
            return Exchange(dist.batch_isend_irecv(ops), group, finish)


def all_gather(
    output: torch.Tensor, chunk: torch.Tensor, group: ProcessGroup, label: int = labels.ALL_GATHER
) -> Pending:
    """``output`` (``world_size`` chunks) receives every rank's ``chunk`` in rank order; ``label`` says what for
    (:mod:`.labels`, on shared memory)."""
    TRAFFIC.record("all_gather", output.nbytes, group)
    activity.entered(label)
    with torch.profiler.record_function("lightning_zero::all_gather_params"):
        if not _point_to_point(group):
            return _all_gather(output, chunk, group=group, async_op=True)
        size, me = group.size(), group.rank()
        rows = output.view(size, -1)
        in_place = chunk.data_ptr() == rows[me].data_ptr() and chunk.is_contiguous()  # `fully_shard` puts it there
        if not in_place:
            rows[me].copy_(chunk)
        if size == 1:
            return Exchange([], group)
        shared = _shared(chunk, group)
        if shared is not None:
            return shared.all_gather(output, label)
        ops, tag = [], exchange_tag(label)
        for peer in range(size):
            if peer != me:
                ops.append(dist.P2POp(dist.isend, chunk, dist.get_global_rank(group, peer), group, tag))
                ops.append(dist.P2POp(dist.irecv, rows[peer], dist.get_global_rank(group, peer), group, tag))
        with _naming_peers(group):
            return Exchange(dist.batch_isend_irecv(ops), group)


def exchange_rows(
    received: torch.Tensor,
    sent: torch.Tensor,
    group: ProcessGroup,
    label: int,
    finish: Callable[[], None] | None = None,
) -> Exchange:
    """An all-to-all: ``received[r]`` (``size`` rows) gets rank ``r``'s ``sent[me]``, then ``finish`` runs (at the
    wait); counted as the reduce-scatter whose chunks it carries (a rank sends each peer its row)."""
    TRAFFIC.record("reduce_scatter", sent.nbytes, group)
    activity.entered(label)
    with torch.profiler.record_function("lightning_zero::exchange_rows"):
        if not _point_to_point(group):
            work = dist.all_to_all_single(received, sent, group=group, async_op=True)
            return Exchange([work], group, finish, holds=(sent, received))
        me = group.rank()
        received[me].copy_(sent[me])
        ops, tag = [], exchange_tag(label)
        for peer in range(group.size()):
            if peer != me:
                ops.append(dist.P2POp(dist.isend, sent[peer], dist.get_global_rank(group, peer), group, tag))
                ops.append(dist.P2POp(dist.irecv, received[peer], dist.get_global_rank(group, peer), group, tag))
        if not ops:
            return Exchange([], group, finish)
        with _naming_peers(group):
            return Exchange(dist.batch_isend_irecv(ops), group, finish, holds=(sent, received))


def meet(label: int, group: ProcessGroup) -> None:
    """A barrier of gloo's point-to-point messages (tagged :data:`MEET_TAG`, so that no collective pairs with them)
    where every rank of ``group`` says ``label``: ranks that are elsewhere fail here, on every rank alike, with
    :class:`~.labels.DivergedError`, as at the shared-memory channel's meetings (:mod:`.labels`). Where torch 2.8's
    ``fully_shard`` runs its own gloo collectives, which pair by count whatever each rank runs, one of a unit paired
    with another unit's, or with Lightning's broadcast, would end the process in gloo (``op.preamble.length <=
    op.nbytes``): a meeting before each keeps them apart."""
    activity.entered(label)
    me = group.rank()
    said = torch.full((group.size(),), label, dtype=torch.int64)
    ops = []
    for peer in range(group.size()):
        if peer != me:
            peer_rank = dist.get_global_rank(group, peer)
            ops.append(dist.P2POp(dist.isend, said[me : me + 1], peer_rank, group, MEET_TAG))
            ops.append(dist.P2POp(dist.irecv, said[peer : peer + 1], peer_rank, group, MEET_TAG))
    with _naming_peers(group):
        Exchange(dist.batch_isend_irecv(ops), group).wait()
    if (said != label).any():
        raise labels.diverged(me, dict(enumerate(said.tolist())))


def broadcast_(tensors: list[torch.Tensor], group: ProcessGroup) -> None:
    """Broadcast ``tensors`` from the group's rank 0 in place, one flat message per dtype."""
    by_dtype = group_by(tensors, lambda t: t.dtype)
    TRAFFIC.record("broadcast", sum(t.nbytes for t in tensors), group)
    with torch.profiler.record_function("lightning_zero::broadcast_buffers"):
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype])
            dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
            parts = flat.split([t.numel() for t in same_dtype])
            torch._foreach_copy_(same_dtype, [part.view_as(t) for part, t in zip(parts, same_dtype, strict=True)])


def all_reduce_hierarchical(buffer: torch.Tensor, shard_group: ProcessGroup, replicas: ProcessGroup) -> Pending:
    """``buffer`` becomes the sum over every rank of the shard groups, only ``1/size`` of it crossing between the
    groups: a reduce-scatter within this rank's shard group, an all-reduce of its chunk across the replicas (the same
    chunk in every group), an all-gather back within the group. ``buffer``'s length must divide by the group size."""
    chunk = buffer.view(shard_group.size(), -1)[shard_group.rank()]
    summed = torch.empty_like(chunk)  # the reduce-scatter's output may not alias its input on every transport

    def across() -> Pending:
        return all_reduce_sum(summed, replicas)

    def back() -> Pending:
        chunk.copy_(summed)
        return all_gather(buffer, chunk, shard_group)

    return Chained(reduce_scatter_sum(summed, buffer, shard_group), [across, back])
