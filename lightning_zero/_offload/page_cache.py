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
  limit leaves beside the working set's peak and a headroom, each rank its share, and all of that but a second
  headroom may be dirty.
- ``"drop"``: a budget of 0 (:class:`Fixed`): every range leaves the page cache as it leaves the process, a written
  one once its writeback is done: what a memory limit meant before the budget.
- a number of bytes: a :class:`Fixed` budget of that much page cache per rank, half of it dirty at most, with or
  without a limit.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lightning_zero._offload.cgroup import MemoryGroup, Usage, limiting_group

HEADROOM_SHARE = 16  # 1/16 of a memory limit is left free beside the working set's peak and the files' pages


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
    reading: int = 0  # ranges read ahead that have not left the process yet


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

    def step_ended(self) -> None:
        """An optimizer step ended: what a step needs has been seen once."""
        ...


@dataclass(frozen=True)
class Fixed:
    """At most ``nbytes`` of this rank's ranges cached, half of that dirty."""

    nbytes: int

    def excess(self, held: Held, incoming: int = 0) -> Excess:
        return Excess(drop=max(held.cached - self.nbytes, 0), write=max(held.dirty - self.nbytes // 2, 0))

    def admits(self, held: Held, incoming: int) -> bool:
        return True  # it budgets the pages that left the process

    def step_ended(self) -> None:
        pass


class Readings(enum.Enum):
    """How much a :class:`GroupRoom` has seen of what a step needs."""

    FIRST_STEP = "first step"  # not a whole step yet: it keeps nothing that left (as "drop"), and learns
    STEADY = "steady"  # a step's working set seen: it keeps what its share holds


class GroupRoom:
    """The room a memory group's limit leaves the page cache, read from the group itself, shared by the ``ranks`` in
    it: the limit less the peak of the group's anonymous memory (every rank's working set, learned from the readings)
    and a headroom for what grows between two readings (:attr:`headroom`, learned too), in equal shares. A rank's
    share holds the pages it works on (the file pages it maps, at their peak so far, learned from its own resident
    memory) and what it reads ahead; the rest may hold the ranges that left it, the oldest dropped beyond it, and all of
    it but the rank's part of a second headroom dirty pages (kept clean, so that a rise of the working set past the
    first headroom finds pages it can reclaim without waiting for the disk). Ranges being dropped stay in
    memory until written back: once the group's page cache is over the room with them, a rank waits for its
    writebacks, so that the group stays below its limit. Pages to read ahead that do not fit the share are read as
    they are used. Until a first optimizer step has ended, the working set is not known: nothing that left is kept
    (:attr:`Readings.FIRST_STEP`)."""

    def __init__(self, group: MemoryGroup, ranks: int = 1, mapped: Callable[[], int] | None = None) -> None:
        self.group = group
        self.ranks = ranks
        self._mapped = mapped or mapped_file_bytes
        self._mapped_at_start = self._mapped()  # the libraries' pages, mapped before any offload file
        self.anonymous_peak = 0  # bytes: the largest anonymous usage the group's readings showed
        self.largest_rise = 0  # bytes: the most the group's usage rose above a reading before the next one
        self.in_use_peak = 0  # bytes: the most this rank mapped of the offload files at once
        self.readings = Readings.FIRST_STEP
        self._last: Usage | None = None

    @property
    def headroom(self) -> int:
        """What is kept free beside the room: 1/:data:`HEADROOM_SHARE` of the limit, or the most the group's usage
        rose above one reading before the next (the ranks gather, compute and write between them) if that is more."""
        return max(self.group.limit // HEADROOM_SHARE, self.largest_rise)

    def room(self) -> int:
        """Bytes of page cache the group may hold, as the readings so far tell."""
        return max(self.group.limit - self.anonymous_peak - self.headroom, 0)

    def share(self) -> int:
        """Bytes this rank's ranges that left it, and those it reads ahead, may hold."""
        if self.readings is Readings.FIRST_STEP:
            return 0
        return max(self.room() // self.ranks - self.in_use_peak, 0)

    def step_ended(self) -> None:
        self.readings = Readings.STEADY

    def excess(self, held: Held, incoming: int = 0) -> Excess:
        usage = self._read()
        share = self.share()
        dirty_allowance = max(share - self.headroom // self.ranks, 0)
        return Excess(
            drop=max(held.cached + held.reading + incoming - share, 0),
            write=max(held.dirty - dirty_allowance, 0),
            over=max(usage.page_cache - self.room(), 0),  # the group's, pages being dropped included
        )

    def admits(self, held: Held, incoming: int) -> bool:
        self._read()
        return self.readings is Readings.FIRST_STEP or held.reading + incoming <= self.share()

    def _read(self) -> Usage:
        usage = self.group.usage()
        self.anonymous_peak = max(self.anonymous_peak, usage.anonymous)
        if self._last is not None:  # what the group's peak shows of the time between, or the usage now
            top = usage.peak if usage.peak > self._last.peak else usage.total
            self.largest_rise = max(self.largest_rise, top - self._last.total)
        self._last = usage
        self.in_use_peak = max(self.in_use_peak, self._mapped() - self._mapped_at_start)
        return usage


def mapped_file_bytes() -> int:
    """Bytes of files this process maps and holds resident (``RssFile``): the pages it works on."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_for(option: PageCacheOption, group: MemoryGroup | None, physical: int, ranks: int = 1) -> Budget | None:
    """The budget of the ``page_cache`` option in this process's limiting ``group`` (``None``: no limit), which
    ``ranks`` processes of the run share, on a machine with ``physical`` bytes of memory; ``None``: no budget, the
    kernel's."""
    match option:
        case PageCache.KEEP:
            return None
        case PageCache.DROP:
            return Fixed(0)
        case PageCache.AUTO:
            return GroupRoom(group, ranks) if group is not None and group.limit < physical else None
        case int():
            return Fixed(option)
    raise ValueError(f"No page-cache budget for {option!r}.")


def this_process_budget(option: PageCacheOption, ranks: int = 1) -> Budget | None:
    """:func:`budget_for` this process, in its own memory group on this machine, with the ``ranks`` of its node."""
    return budget_for(option, limiting_group(), physical_memory(), ranks)
