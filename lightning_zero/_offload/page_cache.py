"""How much of the offload files the page cache may hold (the ``page_cache`` option), as a budget the
:class:`~lightning_zero._offload.writeback.Writeback` keeps.

Vocabulary (see also :mod:`~lightning_zero._offload.cgroup` for the memory group and its usage):

- **leaving** a range of a mapped file: the process drops its pages of it (``MADV_DONTNEED``); the data stays in the
  file, and its pages stay in the page cache until the budget or the kernel drops them.
- **budget**: what this rank's ranges may hold of the page cache, asked after each range leaves the process. Over it,
  the oldest ranges are **dropped** from the page cache (``POSIX_FADV_DONTNEED``; a dirty one written back first);
  beyond its **dirty allowance**, the oldest written ranges are **written back** and stay cached, clean.
- **working set**: the anonymous memory of the group's processes (the units gathered, their gradients, a step's
  temporaries), whose peak the group budget learns from the readings.

The option, resolved by :func:`budget_for`:

- ``"keep"``: no budget. The kernel keeps the files' pages, writes the dirty ones back in its own time (a page
  rewritten before then is written once) and evicts them as it needs memory.
- ``"auto"`` (the default): ``"keep"`` without a memory limit below the machine's memory; under one, a
  :class:`GroupRoom`. A limit counts the page cache, and cgroup v1 has no dirty-page throttling per group: a group
  full of dirty pages cannot reclaim them fast enough and its processes are killed. So the files may fill what the
  limit leaves beside the working set's peak and a headroom, and at most half of that may be dirty.
- ``"drop"``: a budget of 0 (:class:`Fixed`): every range leaves the page cache as it leaves the process, a written
  one once its writeback is done: what a memory limit meant before the budget.
- a number of bytes: a :class:`Fixed` budget of that much page cache per rank, half of it dirty at most, with or
  without a limit.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Protocol

from lightning_zero._offload.cgroup import MemoryGroup, Usage, limiting_group

HEADROOM_SHARE = 16  # 1/16 of a memory limit is left free beside the working set's peak and the files' pages
DIRTY_SHARE = 4  # the group's dirty pages stay under 1/4 of its limit, and under half its page-cache budget


class PageCache(enum.Enum):
    """The ``page_cache`` option's named values (a number of bytes is the fourth kind)."""

    AUTO = "auto"  # a budget of the room a memory limit leaves; without a limit, as KEEP
    KEEP = "keep"  # the kernel's: kept, written back and evicted as it needs memory
    DROP = "drop"  # each range dropped as it leaves the process, once written back


PageCacheOption = PageCache | int


@dataclass(frozen=True)
class Held:
    """What this rank's ranges hold of the page cache by its own count, in bytes."""

    cached: int  # ranges that left the process and stay cached (those being dropped not included)
    dirty: int  # of them, written since their last writeback, which is not started
    writing: int  # ranges whose writeback is under way
    dropping: int  # of them, those dropped once written back


@dataclass(frozen=True)
class Excess:
    """What a budget asks of this rank beyond what is under way already, in bytes, oldest ranges first."""

    drop: int = 0  # to drop from the page cache
    write: int = 0  # dirty ranges to write back, kept cached
    over: int = 0  # what memory holds beyond its bound now, pages still to be dropped included: wait for writebacks


class Budget(Protocol):
    """What the page cache may hold of this rank's ranges."""

    def excess(self, held: Held, incoming: int = 0) -> Excess:
        """What to drop and write back now, ``held`` being this rank's ranges, to make room for ``incoming`` bytes
        about to be read ahead."""
        ...

    def admits(self, held: Held, incoming: int) -> bool:
        """Whether ``incoming`` bytes read ahead fit once this rank's ranges are dropped: if not, they are read as
        used."""
        ...


@dataclass(frozen=True)
class Fixed:
    """At most ``nbytes`` of this rank's ranges cached, half of that dirty."""

    nbytes: int

    def excess(self, held: Held, incoming: int = 0) -> Excess:
        return Excess(drop=max(held.cached - self.nbytes, 0), write=max(held.dirty - self.nbytes // 2, 0))

    def admits(self, held: Held, incoming: int) -> bool:
        return True  # it budgets the pages that left the process


class GroupRoom:
    """The room a memory group's limit leaves the page cache, read from the group itself: its limit less the peak of
    its anonymous memory (every rank's working set, learned from the readings) and a headroom for what grows between
    two readings (:attr:`headroom`: a unit's pages worked on, pages read ahead, learned too). The
    group's page cache beyond it is dropped, each rank dropping its own oldest ranges; its dirty pages beyond
    1/:data:`DIRTY_SHARE` of the limit or half the room are written back. Ranges being dropped stay in memory until
    written back: once the page cache is over the room with them, a rank waits for its writebacks, so that the group
    stays below its limit. Pages read ahead are read only if they fit the room once this rank's ranges are dropped
    (the oldest then go first), else as they are used."""

    def __init__(self, group: MemoryGroup) -> None:
        self.group = group
        self.anonymous_peak = 0  # bytes: the largest anonymous usage read
        self.largest_rise = 0  # bytes: the most the group's usage rose above a reading before the next one
        self._last: Usage | None = None

    @property
    def headroom(self) -> int:
        """What is kept free beside the room: 1/:data:`HEADROOM_SHARE` of the limit, or the most the group's usage
        rose above one reading before the next (the ranks gather, compute and write between them) if that is more."""
        return max(self.group.limit // HEADROOM_SHARE, self.largest_rise)

    def room(self) -> int:
        """Bytes of page cache the group may hold, as the readings so far tell."""
        return max(self.group.limit - self.anonymous_peak - self.headroom, 0)

    def excess(self, held: Held, incoming: int = 0) -> Excess:
        usage = self._read()
        room = self.room()
        dirty_allowance = min(room // 2, self.group.limit // DIRTY_SHARE)
        # the readings count what this rank has set going: pages being dropped and writebacks under way
        return Excess(
            drop=max(usage.page_cache + incoming - held.dropping - room, 0),
            write=max(usage.dirty - held.writing - dirty_allowance, 0),
            over=max(usage.page_cache - room, 0),
        )

    def admits(self, held: Held, incoming: int) -> bool:
        usage = self._read()
        return usage.page_cache - held.cached - held.dropping + incoming <= self.room()

    def _read(self) -> Usage:
        usage = self.group.usage()
        self.anonymous_peak = max(self.anonymous_peak, usage.anonymous)
        if self._last is not None:  # what the group's peak shows of the time between, or the usage now
            top = usage.peak if usage.peak > self._last.peak else usage.total
            self.largest_rise = max(self.largest_rise, top - self._last.total)
        self._last = usage
        return usage


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_for(option: PageCacheOption, group: MemoryGroup | None, physical: int) -> Budget | None:
    """The budget of the ``page_cache`` option in this process's limiting ``group`` (``None``: no limit) on a machine
    with ``physical`` bytes of memory; ``None``: no budget, the kernel's."""
    match option:
        case PageCache.KEEP:
            return None
        case PageCache.DROP:
            return Fixed(0)
        case PageCache.AUTO:
            return GroupRoom(group) if group is not None and group.limit < physical else None
        case int():
            return Fixed(option)
    raise ValueError(f"No page-cache budget for {option!r}.")


def this_process_budget(option: PageCacheOption) -> Budget | None:
    """:func:`budget_for` this process, in its own memory group on this machine."""
    return budget_for(option, limiting_group(), physical_memory())
