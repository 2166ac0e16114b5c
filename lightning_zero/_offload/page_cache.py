"""The page cache of the offload files (``offload_parameters="disk"``, ``offload_optimizer="disk"``): kept by the
kernel, or written back and dropped as training goes, under a memory limit that counts it.

Vocabulary:

- **memory group**: the cgroup whose limit caps this process's memory (SLURM's ``ConstrainRAMSpace``, a Kubernetes
  limit, a systemd slice); its limit counts the page cache the group's processes read or dirty, not only their
  anonymous memory. :func:`memory_limit` reads the tightest limit over the process's group and its ancestors.
- **leaving** a range of a mapped file: the process's pages of it are dropped (``MADV_DONTNEED``); the data stays in
  the file. What happens to the page cache then is the :class:`PageCache` policy.

Without a limit below the machine's memory the page cache keeps the files' pages (:attr:`PageCache.KEPT`): a read
finds them there, the kernel writes dirty ones back in its own time, a page rewritten before that is written once,
and it evicts them as it needs memory. Within a limit (:attr:`PageCache.DROPPED`) the files must not live in the
page cache: cgroup v1 has no dirty-page throttling per group, so a group full of dirty pages cannot reclaim them
fast enough and its processes are killed. Each range then leaves the page cache as it leaves the process
(``POSIX_FADV_DONTNEED``: clean pages go at once, dirty ones start their writeback), and :class:`Writeback` waits for
the oldest dirty ranges (``fdatasync``) and drops them once more than :data:`WRITEBACK_BYTES` are under way, so that
the page cache holds at most that much written data and the pages being read ahead and worked on.
"""

from __future__ import annotations

import enum
import mmap
import os
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

WRITEBACK_BYTES = 256 * 2**20  # written bytes a rank lets wait for their writeback under a memory limit
_UNLIMITED = 2**62  # cgroup v1 reports "no limit" as a number near 2**63


class PageCache(enum.Enum):
    """Where the offload files' pages go once the process has left them."""

    KEPT = "kept"  # the kernel keeps them, writes them back and evicts them as it needs memory
    DROPPED = "dropped"  # written back and dropped as they go: a memory limit counts the page cache


def memory_limit(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of the tightest memory limit over this process's memory group and its ancestors (cgroup v2's
    ``memory.max``, v1's ``memory.limit_in_bytes``); ``None`` where there is none or no cgroup can be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy, mounted at `root` or `root`/unified
            bases, name = [root, root / "unified"], "memory.max"
        elif "memory" in controllers.split(","):
            bases, name = [root / "memory"], "memory.limit_in_bytes"
        else:
            continue
        for base in bases:
            group = base / path.lstrip("/")
            while group.is_relative_to(base):
                limits.append(_read_limit(group / name))
                if group == base:
                    break
                group = group.parent
    known = [limit for limit in limits if limit is not None and limit < _UNLIMITED]
    return min(known, default=None)


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def page_cache_policy() -> PageCache:
    """:attr:`PageCache.DROPPED` where a memory limit below the machine's memory caps this process."""
    limit = memory_limit()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return PageCache.DROPPED if limit is not None and limit < physical else PageCache.KEPT


@dataclass(eq=False)
class MappedFile:
    """A nameless file's descriptor and its shared mapping; the descriptor closes when the mapping is collected."""

    fd: int
    mapping: mmap.mmap

    def __post_init__(self) -> None:
        weakref.finalize(self.mapping, os.close, self.fd)


class Writeback:
    """Makes ranges of mapped files leave the process, and under :attr:`PageCache.DROPPED` the page cache."""

    def __init__(self, policy: PageCache, budget: int = WRITEBACK_BYTES) -> None:
        self.policy = policy
        self.budget = budget
        self._under_way: deque[tuple[MappedFile, int, int]] = deque()  # dirty ranges whose writeback was started
        self._bytes = 0  # in `_under_way`

    def leave(self, file: MappedFile, offset: int, length: int, *, written: bool) -> None:
        """The process is done with ``length`` bytes of ``file`` from ``offset`` (page-aligned) for now; ``written``:
        it wrote them since they last left."""
        if length == 0:
            return
        file.mapping.madvise(mmap.MADV_DONTNEED, offset, length)
        if self.policy is PageCache.KEPT:
            return
        os.posix_fadvise(file.fd, offset, length, os.POSIX_FADV_DONTNEED)  # clean pages go; dirty ones start writing
        if not written:
            return
        self._under_way.append((file, offset, length))
        self._bytes += length
        while self._bytes > self.budget:
            self._drop_oldest()

    def drain(self) -> None:
        """Wait for every write under way and drop its pages (the end of an optimizer step)."""
        while self._under_way:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        file, offset, length = self._under_way.popleft()
        self._bytes -= length
        os.fdatasync(file.fd)
        os.posix_fadvise(file.fd, offset, length, os.POSIX_FADV_DONTNEED)
