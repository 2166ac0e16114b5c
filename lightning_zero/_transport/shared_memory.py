"""Collectives between the processes of one host through shared memory, for CPU (gloo) process groups.

Gloo moves CPU tensors between local processes over TCP loopback: on 2 processes of the CI machine a 4 MB
all-gather takes about 4 ms and even a one-element all-reduce 0.8 ms. Here each rank owns a *segment*, a file in
``/dev/shm`` that every rank of the group has mapped, and a collective is: each rank copies its part into its own
segment, a *barrier*, each rank copies (or sums) what it needs out of the others' segments.

Words used below:

- *barrier*: every rank writes one *message* into a FIFO towards each peer, then reads one from each peer (~3 us): a
  *status byte* and the collective's *label* (:mod:`.labels`), compared with this rank's own. A pair of ranks has its
  own FIFO each way, so the k-th message read from a peer is that peer's k-th barrier's (a message is written at once,
  and FIFO writes that short are never split).
- *slot*: half of a segment, ``SLOT_BYTES`` long. A collective larger than a slot runs in *pieces*; the k-th piece of
  the channel's life uses slot ``k % 2`` of every segment.
- *in order*: a piece starts only after this rank has finished the previous piece (its barrier and its reads). So when
  a rank writes piece k+1, every rank has entered piece k, hence finished piece k-1, the last one in the same slot.
  Two slots are enough, and a rank's segment needs no lock.
- *gather ring*: for stage 3, ``RING_SIZE`` buffers in one more shared file, each big enough for the largest unit's
  gathered parameters. ``fully_shard`` allocates its all-gather output there and copies this rank's shard into its row
  itself: the all-gather is then a barrier alone, and every rank reads the gathered unit from the one shared copy. A
  buffer is handed out again only when every rank has said, in a status byte (a bit per buffer), that nothing of its
  own still holds it, so a rank never writes rows another rank is still reading, whatever order ``fully_shard``
  gathers and releases units in.

The channel opens when a group's first CPU collective runs, only if every rank can map every other rank's segment;
otherwise (ranks on several hosts, no ``/dev/shm``) the group keeps gloo and results do not change, only speed.
``LIGHTNING_ZERO_SHM_DISABLE=1`` keeps gloo everywhere. A rank that fails while its peers wait is noticed within a
second (it announced its failure, :mod:`.failures`, or its PID is gone) and reported; one that stays alive but does
not arrive is reported after the group's timeout (:mod:`.peers`), as gloo's own collectives do.

The files are named after the rank that creates them and unlinked as soon as every rank holds them; what a rank
killed in between leaves is removed when the next channel opens (:mod:`lightning_zero._transport.shm_files`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
from collections.abc import Generator
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_zero._files import reserved_mapping
from lightning_zero._transport import failures, labels, peers, shm_files, stalls

SLOT_BYTES = 4 * 2**20
RING_SIZE = 3  # gather buffers: the unit being gathered, one prefetched, one still being read by a slower rank
_WHERE = "shared-memory collective"
_DISABLE = "LIGHTNING_ZERO_SHM_DISABLE"
_POLL_SECONDS = 1.0  # how often a waiting rank checks that its peers are alive
_MESSAGE_BYTES = 5  # a barrier's message: the status byte, then the label (4 bytes, little-endian)
_CHANNELS: dict[ProcessGroup, Channel | None] = {}
_RING_HANDOUTS = [0]  # gather-ring buffers this process's channels handed out (see ``ring_handouts``)


def channel(group: ProcessGroup) -> Channel | None:
    """The shared-memory channel of ``group``, opened (a collective over gloo) at its first use; None where gloo
    stays."""
    if group not in _CHANNELS:
        with peers.naming_peers("shared-memory channel's opening", group):
            _CHANNELS[group] = Channel.open(group) if group.size() > 1 else None
    return _CHANNELS[group]


def _wanted_here() -> bool:
    """This rank can and may share memory (each rank answers for itself; the group uses it only if all can)."""
    supported = shm_files.DIRECTORY.is_dir() and hasattr(os, "posix_fallocate") and hasattr(os, "mkfifo")  # Linux
    return supported and os.environ.get(_DISABLE, "0") != "1"


def mapped_bytes() -> int:
    """Bytes of shared memory this process has mapped for its channels: every rank's segment and the gather ring."""
    return sum(c.mapped_bytes for c in _CHANNELS.values() if c is not None)


def ring_handouts() -> int:
    """How many all-gather outputs this process's channels have placed in a gather ring so far: gathers that moved no
    bytes through the channel's slots."""
    return _RING_HANDOUTS[0]


def close_all(failed: bool = False) -> None:
    """Unmap every channel (at exit, before the process group goes), telling the peers that this rank leaves, after an
    exception if ``failed``: a peer still waiting for it then fails at once (see :mod:`.labels`)."""
    farewell = labels.LEFT_FAILED if failed else labels.LEFT
    for opened in _CHANNELS.values():
        if opened is not None:
            opened.close(farewell)
    _CHANNELS.clear()


class InFlight:
    """A collective in flight: its first piece is written and announced; ``wait`` runs the rest."""

    def __init__(self, pieces: Generator[None, None, None]) -> None:
        self._pieces: Generator[None, None, None] | None = pieces
        next(pieces)  # up to the first piece's barrier

    def wait(self) -> bool:
        if self._pieces is not None:
            pieces, self._pieces = self._pieces, None
            for _ in pieces:
                pass
        return True


class Channel:
    """Shared segments and FIFOs between the ranks of one group, all on this host."""

    def __init__(
        self,
        group: ProcessGroup,
        maps: list[mmap.mmap],
        inboxes: list[int],
        outboxes: list[int],
        prefixes: list[str],
        timeout: timedelta,
    ) -> None:
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        self._maps = maps  # per rank of the group, its segment
        # per rank, per slot: 1D uint8 views of the segments
        self._slots = [[torch.frombuffer(m, dtype=torch.uint8, count=SLOT_BYTES, offset=s * SLOT_BYTES) for s in (0, 1)]
                       for m in maps]
        self._peer_ranks = [rank for rank in range(self.size) if rank != self.rank]
        self._inbox_peers = dict(zip(inboxes, self._peer_ranks, strict=True))  # read end of a FIFO -> who writes it
        self._outboxes = outboxes  # write ends of the FIFOs to each peer, in rank order
        # per peer rank, the process that created its files, where it can be watched (this PID namespace)
        self._watched = _watchable(prefixes, self.rank)
        self._pids = {rank: creator.pid for rank, creator in self._watched.items()}
        self._timeout = timeout
        self._slot_views: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # the slots in each dtype used
        self._pieces = 0
        self._in_flight: InFlight | None = None
        self._ring: GatherRing | None = None
        self._ring_free = 0  # bit i: ring buffer i released by every rank, as of the last barrier
        # the error that ended the channel: a peer stalled or exited, and the FIFOs' byte order is lost with it; or the
        # ranks diverged
        self._broken: peers.PeerError | labels.DivergedError | None = None
        peers.witness_timeouts()
        self._timeouts_seen = peers.timeouts_witnessed()  # as of the last barrier every peer arrived at

    @classmethod
    def open(cls, group: ProcessGroup) -> Channel | None:
        """Collective over ``group``: every rank creates its segment and its FIFOs from each peer, then maps everyone's
        segment and opens its FIFOs to each peer. The files are unlinked as soon as all ranks hold them (or opening
        fails), so nothing is left in ``/dev/shm`` whatever happens later. Collectives then wait for a peer as long as
        the group's own timeout."""
        me, size = group.rank(), group.size()
        peer_ranks = [rank for rank in range(size) if rank != me]
        created: list[Path] = []
        fds: list[int] = []
        own: tuple[str, mmap.mmap, list[int]] | None = None  # this rank's prefix, segment, FIFOs from each peer
        agreed = False
        try:
            if _wanted_here():
                with contextlib.suppress(OSError):  # no room in /dev/shm, no FIFOs: the group keeps gloo
                    own = _create_own(me, peer_ranks, created, fds)
            prefixes: list[str | None] = [None] * size  # where every rank's files are, which names their creator
            dist.all_gather_object(prefixes, None if own is None else own[0], group=group)
            maps: list[mmap.mmap] = []
            outboxes: list[int] = []
            if own is not None and all(prefixes):
                with contextlib.suppress(OSError):
                    maps = [own[1] if rank == me else _map(_segment(prefixes[rank], rank), 2 * SLOT_BYTES)
                            for rank in range(size)]
                    for peer in peer_ranks:
                        outboxes.append(os.open(_fifo(prefixes[peer], me, peer), os.O_WRONLY))
                        fds.append(outboxes[-1])
            agreed = _all_agree(len(maps) == size and len(outboxes) == len(peer_ranks), group)
        finally:
            for path in created:
                path.unlink(missing_ok=True)
            if not agreed:
                for fd in fds:
                    os.close(fd)
        if not agreed or own is None:
            return None
        return cls(group, maps, own[2], outboxes, prefixes, peers.group_timeout(group))  # type: ignore[arg-type]

    def open_gather_ring(self, buffer_bytes: int) -> bool:
        """Collective: rank 0 creates the stage-3 gather ring of ``RING_SIZE`` buffers of ``buffer_bytes``, every rank
        maps it. False (and no ring) where ``/dev/shm`` has no room for it."""
        self._finish_in_flight()
        self._ring = None  # an earlier ring's buffers stay alive while ``fully_shard`` holds them, never handed out
        created: list[Path] = []
        mapped: mmap.mmap | None = None
        size = RING_SIZE * buffer_bytes
        try:
            if self.rank == 0:
                with contextlib.suppress(OSError):
                    mapped = _create_segment(Path(f"{shm_files.new_prefix()}.ring"), size, created)
            name = [created[0] if created else None]  # rank 0's ring; None where it could not create one
            dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
            if name[0] is not None and self.rank != 0:
                with contextlib.suppress(OSError):
                    mapped = _map(name[0], size)
            agreed = _all_agree(mapped is not None, self.group)
        finally:
            for path in created:
                path.unlink(missing_ok=True)
        if not agreed or mapped is None:
            return False
        self._ring = GatherRing(mapped, buffer_bytes)
        self._ring_free = self._ring.released()
        return True

    def gather_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A ring buffer for an all-gather output of ``numel`` elements, or None: no ring, too large, or no buffer
        released by every rank. Every rank decides alike: from sizes and from the status bytes of the last barrier."""
        self._finish_in_flight()
        if self._ring is None or numel * dtype.itemsize > self._ring.buffer_bytes or not self._ring_free:
            return None
        index = (self._ring_free & -self._ring_free).bit_length() - 1  # the lowest free one
        self._ring_free &= ~(1 << index)
        _RING_HANDOUTS[0] += 1
        return self._ring.buffer(index, numel, dtype)

    def all_gather(self, output: torch.Tensor, label: int = labels.ALL_GATHER) -> InFlight:
        """``output`` (``size`` chunks, this rank's already in place) receives every other rank's in rank order."""
        rows = output.view(self.size, -1)
        if self._ring is not None and self._ring.holds(output):
            return self._start(self._barrier(label))  # every rank wrote its row of the one shared buffer
        return self._start(self._all_gather(rows, label))

    def reduce_scatter_sum(
        self, output: torch.Tensor, buffer: torch.Tensor, label: int = labels.REDUCE_SCATTER
    ) -> InFlight:
        """``output`` (one chunk) receives the sum, in rank order, of every rank's chunk ``rank`` of ``buffer``."""
        return self._start(self._reduce_scatter(output.view(-1), buffer.view(self.size, -1), label))

    def all_reduce_sum(self, buffer: torch.Tensor) -> InFlight:
        """``buffer`` becomes the sum over ranks, added in rank order, so bit-identical on every rank."""
        return self._start(self._all_reduce(buffer.view(-1)))

    def meet(self, label: int) -> None:
        """A barrier alone, where every rank says ``label``: ranks that are elsewhere fail here (see :mod:`.labels`)."""
        self._start(self._barrier(label)).wait()

    @property
    def mapped_bytes(self) -> int:
        ring = 0 if self._ring is None else RING_SIZE * self._ring.buffer_bytes
        return sum(len(m) for m in self._maps) + ring

    def close(self, farewell: int = labels.LEFT) -> None:
        """Unmap the segments and close the FIFOs, after sending the peers one last message: ``farewell``."""
        if self._broken is None:
            message = bytes([0]) + farewell.to_bytes(4, "little")
            for fd in self._outboxes:
                with contextlib.suppress(OSError):  # that peer is gone already
                    os.write(fd, message)
        self._slots, self._slot_views, self._ring = [], {}, None
        for fd in (*self._inbox_peers, *self._outboxes):
            os.close(fd)
        self._inbox_peers, self._outboxes = {}, []

    def _start(self, pieces: Generator[None, None, None]) -> InFlight:
        self._finish_in_flight()
        self._in_flight = InFlight(pieces)
        return self._in_flight

    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:  # in order: see the module's docstring
            self._in_flight.wait()
            self._in_flight = None

    def _all_gather(self, rows: torch.Tensor, label: int) -> Generator[None, None, None]:
        chunk = rows[self.rank]
        for start, stop in _spans(chunk.numel(), SLOT_BYTES // chunk.element_size()):
            slot = self._next_slot(chunk.dtype)
            slot[self.rank][: stop - start].copy_(chunk[start:stop])
            yield from self._barrier(label)
            for rank in self._peers():
                rows[rank, start:stop].copy_(slot[rank][: stop - start])

    def _reduce_scatter(self, output: torch.Tensor, chunks: torch.Tensor, label: int) -> Generator[None, None, None]:
        # Peers need only their own chunks of this rank's buffer; this rank's chunk is read in place, unless
        # ``output`` overlaps the buffer (the sum would overwrite it before reading it).
        own_in_place = not _overlap(output, chunks)
        width = SLOT_BYTES // (chunks.element_size() * self.size)
        for start, stop in _spans(output.numel(), width):
            staged = [s[: self.size * (stop - start)].view(self.size, -1) for s in self._next_slot(chunks.dtype)]
            for rank in range(self.size):
                if rank != self.rank or not own_in_place:
                    staged[self.rank][rank].copy_(chunks[rank, start:stop])
            yield from self._barrier(label)
            addends = [staged[rank][self.rank] for rank in range(self.size)]
            if own_in_place:
                addends[self.rank] = chunks[self.rank, start:stop]
            _sum_into(output[start:stop], addends)

    def _all_reduce(self, buffer: torch.Tensor) -> Generator[None, None, None]:
        for start, stop in _spans(buffer.numel(), SLOT_BYTES // buffer.element_size()):
            slot = self._next_slot(buffer.dtype)
            slot[self.rank][: stop - start].copy_(buffer[start:stop])
            yield from self._barrier(labels.ALL_REDUCE)
            _sum_into(buffer[start:stop], [slot[rank][: stop - start] for rank in range(self.size)])

    def _next_slot(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The next piece's slot of every rank's segment, as ``dtype`` elements."""
        index = self._pieces % 2
        self._pieces += 1
        key = (index, dtype)
        if key not in self._slot_views:
            self._slot_views[key] = [slots[index].view(dtype) for slots in self._slots]
        return self._slot_views[key]

    def _peers(self) -> list[int]:
        return self._peer_ranks

    def _barrier(self, label: int) -> Generator[None, None, None]:
        """Send this rank's message (status byte and ``label``) to every peer, pause (the caller goes on after a
        collective's first piece), then read every peer's: a peer's other label ends the channel with
        :class:`~.labels.DivergedError`, on every rank alike; the ring buffers every rank has released are those of all
        the status bytes."""
        if self._broken is not None:  # report it again at once: waiting another timeout would tell nothing new
            raise self._broken.with_traceback(None)
        if peers.timeouts_witnessed() != self._timeouts_seen:  # this rank already waited a timeout since they met
            if (found := stalls.check_now(ask=False)) is not None:  # no: a verdict's release ended that collective
                self._break(found)
            missing = peers.ranks(self._peers(), self._pids, one_of=True)
            pids = list(self._pids.values())
            self._break(peers.stalled(_WHERE, self.rank, missing, self._timeout, pids, peers.last_timeout()))
        status = self._ring.released() if self._ring is not None else 0
        message = bytes([status]) + label.to_bytes(4, "little")
        for fd, rank in zip(self._outboxes, self._peers(), strict=True):
            try:
                os.write(fd, message)
            except BrokenPipeError:  # the reader of that FIFO is gone
                self._break(peers.exited(_WHERE, self.rank, rank, self._pids))
        yield
        if self._broken is not None:
            raise self._broken.with_traceback(None)
        received = self._read_peers()
        said = message[1:]
        for other in received.values():
            if other[1:] != said:
                self._break(self._divergence(received, label))
            status &= other[0]
        self._ring_free = status
        self._timeouts_seen = peers.timeouts_witnessed()

    def _divergence(self, received: dict[int, bytes], label: int) -> peers.PeerError | labels.DivergedError:
        """The error of a barrier where the peers' messages (``received``) carry other labels than this rank's."""
        doing = {rank: int.from_bytes(other[1:], "little") for rank, other in received.items()}
        failed = [rank for rank, said in doing.items() if said == labels.LEFT_FAILED]
        if failed:  # that rank's own error is the one to read: the one it announced, if it did
            return self._failure_of(failed[0]) or peers.exited(_WHERE, self.rank, failed[0], self._pids)
        return labels.diverged(self.rank, {**doing, self.rank: label})

    def _read_peers(self) -> dict[int, bytes]:
        """One message from each peer's FIFO (peer rank -> message), waiting as long as the timeout while the peers are
        alive."""
        waiting = dict(self._inbox_peers)
        received = {}
        timeout = self._timeout.total_seconds()
        deadline: float | None = None  # known once a first wait comes back empty: the common case never asks the clock
        while waiting:
            left = timeout if deadline is None else deadline - time.monotonic()
            ready, _, _ = select.select(list(waiting), [], [], min(_POLL_SECONDS, max(left, 0.0)))
            for fd in ready:
                received[waiting.pop(fd)] = os.read(fd, _MESSAGE_BYTES)
            if ready:
                continue
            if deadline is None:  # that wait took min(_POLL_SECONDS, timeout) of it
                deadline = time.monotonic() + timeout - min(_POLL_SECONDS, timeout)
                left = deadline - time.monotonic()
            if (found := stalls.verdict()) is not None:  # the ranks went different ways, or a peer stopped
                self._break(found)
            for rank in waiting.values():  # what a failed peer announced says more than its exit
                if (error := self._failure_of(rank)) is not None:
                    self._break(error)
                if rank in self._watched and self._watched[rank].is_dead():
                    self._break(peers.exited(_WHERE, self.rank, rank, self._pids))
            if left <= 0:
                missing = sorted(waiting.values())
                pids = [self._pids[r] for r in missing if r in self._pids]
                self._break(peers.stalled(_WHERE, self.rank, peers.ranks(missing, self._pids), self._timeout, pids))
        return received

    def _failure_of(self, rank: int) -> peers.PeerError | None:
        """The error naming what peer ``rank`` announced it failed with, if it did."""
        failure = failures.announced(dist.get_global_rank(self.group, rank))
        return None if failure is None else failures.failed(_WHERE, self.rank, rank, failure, self._pids)

    def _break(self, error: peers.PeerError | labels.DivergedError) -> NoReturn:
        """End the channel with ``error``: every later collective raises it at once (several can be in flight, and
        autograd runs the end-of-backward callback even after a hook failed)."""
        self._broken = error
        raise error


class GatherRing:
    """``RING_SIZE`` shared buffers for stage 3's gathered units; this rank's view of which it still holds."""

    def __init__(self, mapped: mmap.mmap, buffer_bytes: int) -> None:
        self.buffer_bytes = buffer_bytes
        self._bases = [torch.frombuffer(mapped, dtype=torch.uint8, count=buffer_bytes, offset=i * buffer_bytes)
                       for i in range(RING_SIZE)]
        self._storages = [base.untyped_storage() for base in self._bases]
        # references to a buffer while nothing else holds it: the base tensor and the storage object above
        self._idle_uses = [_uses(storage) for storage in self._storages]

    def buffer(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._bases[index][: numel * dtype.itemsize].view(dtype)

    def holds(self, tensor: torch.Tensor) -> bool:
        return any(tensor.untyped_storage().data_ptr() == s.data_ptr() for s in self._storages)

    def released(self) -> int:
        """Bit i set: no tensor of this process refers to buffer i any more."""
        return sum(1 << i for i, (s, idle) in enumerate(zip(self._storages, self._idle_uses, strict=True))
                   if _uses(s) == idle)


def _uses(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _all_agree(ok: bool, group: ProcessGroup) -> bool:
    """Collective: whether every rank of ``group`` says ``ok``."""
    everyone: list[bool] = [False] * group.size()
    dist.all_gather_object(everyone, ok, group=group)
    return all(everyone)


def _create_own(
    me: int, peer_ranks: list[int], created: list[Path], fds: list[int]
) -> tuple[str, mmap.mmap, list[int]]:
    """This rank's files of a new channel, after reclaiming what dead runs left: the prefix of their paths, its
    segment, and its FIFOs from each peer (opened for reading)."""
    shm_files.reclaim()
    prefix = shm_files.new_prefix()
    segment = _create_segment(_segment(prefix, me), 2 * SLOT_BYTES, created)
    return prefix, segment, [_create_fifo(_fifo(prefix, peer, me), created, fds) for peer in peer_ranks]


def _segment(prefix: str, rank: int) -> Path:
    """The segment of group rank ``rank``, whose files start with ``prefix``."""
    return Path(f"{prefix}-{rank}.seg")


def _fifo(prefix: str, writer: int, reader: int) -> Path:
    """The FIFO from ``writer`` to ``reader``, created by ``reader`` (whose files start with ``prefix``)."""
    return Path(f"{prefix}-{writer}-{reader}.fifo")


def _create_segment(path: Path, size: int, created: list[Path]) -> mmap.mmap:
    """A new shared file of ``size`` bytes, mapped, recorded in ``created`` for unlinking once every rank holds it."""
    mapped = reserved_mapping(path, size)
    created.append(path)
    return mapped


def _create_fifo(path: Path, created: list[Path], fds: list[int]) -> int:
    """A FIFO opened for reading (read-write, so that opening does not wait for the writer)."""
    os.mkfifo(path, 0o600)
    created.append(path)
    fds.append(os.open(path, os.O_RDWR))
    return fds[-1]


def _map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _watchable(prefixes: list[str], me: int) -> dict[int, shm_files.Creator]:
    """Per peer rank, the process that created its files (named in its ``prefixes`` entry), where this process can
    tell whether it is alive: in the same PID namespace."""
    mine = shm_files.Creator.this_process()
    creators = {
        rank: shm_files.Creator.of(Path(prefix).name, shm_files.PREFIX)
        for rank, prefix in enumerate(prefixes)
        if rank != me
    }
    if mine is None:
        return {}
    return {rank: c for rank, c in creators.items() if c is not None and c.namespace == mine.namespace}


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def _spans(numel: int, width: int) -> Generator[tuple[int, int], None, None]:
    for start in range(0, max(numel, 1), width):
        yield start, min(start + width, numel)


def _sum_into(out: torch.Tensor, addends: list[torch.Tensor]) -> None:
    torch.add(addends[0], addends[1], out=out)
    for addend in addends[2:]:
        out.add_(addend)
