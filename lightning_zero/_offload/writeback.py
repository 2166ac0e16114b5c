"""Ranges of the offload files leaving the process, and the page cache they then hold kept within a
:class:`~lightning_zero._offload.page_cache.Budget` (see that module for the words).

A :class:`Writeback` without a budget only makes ranges leave the process: the kernel does the rest. With one it
keeps every range that left in the order it left (least recently used first), each in a :class:`RangeState`, and
after each range leaves asks the budget what is over it:

- to **drop**, oldest first: a clean range goes at once (``POSIX_FADV_DONTNEED``); a dirty one starts its writeback
  and goes once that is done;
- to **write back**, oldest dirty ranges first: their writeback starts, and they stay cached, clean, once done.

Ranges read ahead (:meth:`Writeback.read_ahead`) are in use again: none is dropped until it leaves again, as the newest
(one that was about to be dropped stays), and they are read ahead only if the budget has room for them. Writebacks are
of a range, not of its file (:mod:`.sync_range`), and at most ``under_way`` bytes of them are waited for at a time: past
that, the oldest is waited for before the next starts, which paces the writes to the disk's speed; a budget that finds
memory over its bound has the oldest waited for until it is not. The ranges hold their files weakly: a file the process
let go of takes its ranges along.
"""

from __future__ import annotations

import enum
import mmap
import os
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

from lightning_zero._offload.page_cache import Budget, Held
from lightning_zero._offload.sync_range import start_writeback, wait_written

UNDER_WAY_BYTES = 256 * 2**20  # bytes of writebacks a rank lets run before it waits for the oldest


@dataclass(eq=False)
class MappedFile:
    """A nameless file's descriptor and its shared mapping; the descriptor closes when the mapping is collected."""

    fd: int
    mapping: mmap.mmap

    def __post_init__(self) -> None:
        weakref.finalize(self.mapping, os.close, self.fd)


@dataclass
class Traffic:
    """What a :class:`Writeback` did so far, for benchmarks and tests."""

    written_back: int = 0  # bytes whose writeback it started
    dropped: int = 0  # bytes it dropped from the page cache
    waited: float = 0.0  # seconds it waited for writebacks


class RangeState(enum.Enum):
    """A cached range's pages against its file."""

    CLEAN = "clean"  # as in the file: dropping them costs nothing
    DIRTY = "dirty"  # written since the last writeback, which has not started
    WRITING = "writing"  # its writeback started and was not waited for yet


@dataclass(eq=False)
class CachedRange:
    """``length`` bytes from ``offset`` of a file, which left the process and may still be in the page cache."""

    file: weakref.ref[MappedFile]
    offset: int
    length: int
    state: RangeState = RangeState.CLEAN
    dropping: bool = False  # dropped once its writeback is done
    writes: int = 0  # how many times it became dirty: a writeback waited for clears only the one it started

    def overlaps(self, offset: int, length: int) -> bool:
        return self.offset < offset + length and offset < self.offset + self.length


class Writeback:
    """Makes ranges of mapped files leave the process, and keeps their pages in the page cache within ``budget``
    (``None``: as the kernel sees fit; see the module)."""

    def __init__(self, budget: Budget | None, under_way: int = UNDER_WAY_BYTES) -> None:
        self.budget = budget
        self.under_way = under_way
        self._ranges: OrderedDict[CachedRange, None] = OrderedDict()  # least recently used first
        self._dirty: OrderedDict[CachedRange, None] = OrderedDict()  # of them the DIRTY ones, in the same order
        self._of_file: weakref.WeakKeyDictionary[MappedFile, list[CachedRange]] = weakref.WeakKeyDictionary()
        self._writing: deque[tuple[CachedRange, int]] = deque()  # writebacks under way, oldest first: range, writes
        self._cached = self._dirty_bytes = self._writing_bytes = self._dropping_bytes = 0
        # ranges read ahead and not left since, by file: offset -> length
        self._ahead: weakref.WeakKeyDictionary[MappedFile, dict[int, int]] = weakref.WeakKeyDictionary()
        self._ahead_bytes = 0
        self.traffic = Traffic()

    # --- what the offload files tell ---------------------------------------------------------------------------------

    def leave(self, file: MappedFile, offset: int, length: int, *, written: bool) -> None:
        """The process is done with ``length`` bytes of ``file`` from ``offset`` (page-aligned) for now; ``written``:
        it wrote them since they last left."""
        if length == 0:
            return
        file.mapping.madvise(mmap.MADV_DONTNEED, offset, length)
        if self.budget is None:
            return
        self._arrived(file, offset, length)
        cached = self._take(file, offset, length)
        if written:
            self._set(cached, RangeState.DIRTY)
        self._list(cached)
        self._keep_within_budget()

    def read_ahead(self, file: MappedFile, offset: int, length: int) -> None:
        """Have the kernel read ``length`` bytes of ``file`` from ``offset`` while the process works on others, if the
        budget has room for them (the oldest ranges dropped to make it); their ranges are in use until they leave
        again, and stay if they were to be dropped."""
        if self.budget is not None:
            self._reading(file, offset, length)
            ahead = self._ahead.setdefault(file, {})
            if ahead.get(offset) == length:
                return  # read ahead already
            if not self.budget.admits(self.held, length):
                return  # read as they are used
            self._keep_within_budget(incoming=length)
            ahead[offset] = length
            self._ahead_bytes += length
        file.mapping.madvise(mmap.MADV_WILLNEED, offset, length)

    def _arrived(self, file: MappedFile, offset: int, length: int) -> None:
        """Ranges of ``file`` read ahead that overlap what just left are no longer ahead."""
        ahead = self._ahead.get(file)
        for start, size in list(ahead.items()) if ahead else ():
            if start < offset + length and offset < start + size:
                del ahead[start]
                self._ahead_bytes -= size

    def _reading(self, file: MappedFile, offset: int, length: int) -> None:
        """The ranges being read ahead are in use again: out of the order (and kept) until they leave again."""
        for cached in self._of_file.get(file, ()):
            if cached.overlaps(offset, length):
                self._unlist(cached)

    def step_ended(self) -> None:
        """An optimizer step ended (its budget learns from whole steps)."""
        if self.budget is not None:
            self.budget.step_ended()

    def drain(self) -> None:
        """Wait for every writeback under way (and drop the ranges that were to go)."""
        while self._writing:
            self._wait_oldest()

    @property
    def held(self) -> Held:
        """This rank's ranges, by its own count."""
        return Held(self._cached, self._dirty_bytes, self._writing_bytes, self._dropping_bytes, self._ahead_bytes)

    # --- the budget --------------------------------------------------------------------------------------------------

    def _keep_within_budget(self, incoming: int = 0) -> None:
        assert self.budget is not None
        excess = self.budget.excess(self.held, incoming)
        drop, write = excess.drop, excess.write
        going = []
        for cached in self._ranges if drop > 0 else ():
            if drop <= 0:
                break
            if not cached.dropping:
                going.append(cached)
                drop -= cached.length
                write -= cached.length if cached.state is RangeState.DIRTY else 0
        for cached in going:
            self._drop(cached)
        written = []
        for cached in self._dirty if write > 0 else ():
            if write <= 0:
                break
            written.append(cached)
            write -= cached.length
        for cached in written:
            self._start(cached)
        while self._writing and (self._writing_bytes > self.under_way or excess.over > 0):
            self._wait_oldest()
            if excess.over > 0:
                excess = self.budget.excess(self.held)

    def _drop(self, cached: CachedRange) -> None:
        """Drop ``cached`` from the page cache: now if it is clean, once written back if not."""
        if cached.state is RangeState.CLEAN:
            self._forget(cached)
            self._discard(cached)
            return
        cached.dropping = True
        self._cached -= cached.length
        self._dropping_bytes += cached.length
        if cached.state is RangeState.DIRTY:
            self._start(cached)

    def _start(self, cached: CachedRange) -> None:
        """Start writing back a dirty range."""
        file = cached.file()
        if file is None:
            self._forget(cached)
            return
        start_writeback(file.fd, cached.offset, cached.length)
        self.traffic.written_back += cached.length
        self._set(cached, RangeState.WRITING)
        self._writing.append((cached, cached.writes))
        self._writing_bytes += cached.length

    def _wait_oldest(self) -> None:
        """Wait for the oldest writeback under way; its range is clean then, unless written again since it started,
        and goes if it was to be dropped."""
        cached, writes = self._writing.popleft()
        self._writing_bytes -= cached.length
        file = cached.file()
        if file is not None:
            started = time.perf_counter()
            wait_written(file.fd, cached.offset, cached.length)
            self.traffic.waited += time.perf_counter() - started
        if cached.writes != writes or cached.state is not RangeState.WRITING:
            return  # written again (or replaced) since: its pages are dirty again
        self._set(cached, RangeState.CLEAN)
        if cached.dropping and cached in self._ranges:
            self._forget(cached)
            self._discard(cached)

    def _discard(self, cached: CachedRange) -> None:
        """Drop a clean range's pages from the page cache."""
        file = cached.file()
        if file is not None:
            os.posix_fadvise(file.fd, cached.offset, cached.length, os.POSIX_FADV_DONTNEED)
            self.traffic.dropped += cached.length

    # --- the ranges --------------------------------------------------------------------------------------------------

    def _set(self, cached: CachedRange, state: RangeState) -> None:
        """Change ``cached``'s state, keeping the dirty ranges and their count."""
        if cached in self._dirty:
            del self._dirty[cached]
            self._dirty_bytes -= cached.length
        if state is RangeState.DIRTY:
            cached.writes += 1
            if cached in self._ranges:
                self._dirty[cached] = None
                self._dirty_bytes += cached.length
        cached.state = state

    def _list(self, cached: CachedRange) -> None:
        """List ``cached`` as the newest range."""
        self._ranges[cached] = None
        self._cached += cached.length
        if cached.state is RangeState.DIRTY:
            self._dirty[cached] = None
            self._dirty_bytes += cached.length

    def _take(self, file: MappedFile, offset: int, length: int) -> CachedRange:
        """The range of ``file`` that just left, out of the order: the one kept for the same bytes, or a new one in
        place of those it overlaps, dirty if any of them was not clean; what they held beyond it stays, as the
        newest ranges."""
        ranges = self._of_file.setdefault(file, [])
        overlapping = [cached for cached in ranges if cached.overlaps(offset, length)]
        if len(overlapping) == 1 and (overlapping[0].offset, overlapping[0].length) == (offset, length):
            cached = overlapping[0]
            self._unlist(cached)
            return cached
        taken = CachedRange(weakref.ref(file), offset, length)
        for cached in overlapping:
            self._forget(cached)
            state = RangeState.CLEAN if cached.state is RangeState.CLEAN else RangeState.DIRTY
            if state is RangeState.DIRTY:
                taken.state, taken.writes = state, 1
            for start, end in ((cached.offset, offset), (offset + length, cached.offset + cached.length)):
                if start < end:
                    rest = CachedRange(taken.file, start, end - start, state, writes=int(state is RangeState.DIRTY))
                    ranges.append(rest)
                    self._list(rest)
        ranges.append(taken)
        return taken

    def _unlist(self, cached: CachedRange) -> None:
        """Take ``cached`` out of the order (it is listed again as the newest), keeping it under its file."""
        if cached in self._ranges:
            del self._ranges[cached]
            if cached.dropping:
                cached.dropping = False
                self._dropping_bytes -= cached.length
            else:
                self._cached -= cached.length
        if cached in self._dirty:
            del self._dirty[cached]
            self._dirty_bytes -= cached.length

    def _forget(self, cached: CachedRange) -> None:
        """No longer keep ``cached`` (a writeback under way of it is still waited for)."""
        self._unlist(cached)
        if cached.state is RangeState.WRITING:
            cached.writes += 1  # its writeback's end no longer concerns a kept range
        file = cached.file()
        ranges = self._of_file.get(file) if file is not None else None
        if ranges is not None and cached in ranges:
            ranges.remove(cached)
