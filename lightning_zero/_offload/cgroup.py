"""The memory group this process runs in, as the kernel reports it: its limit, and what the group uses now.

Vocabulary:

- **memory group**: the cgroup whose limit caps this process's memory (SLURM's ``ConstrainRAMSpace``, a Kubernetes
  limit, a systemd slice); its limit counts the page cache the group's processes read or dirty, not only their
  anonymous memory. The **limiting group** is the one with the tightest limit over the process's group and its
  ancestors (cgroup v2's ``memory.max``, v1's ``memory.limit_in_bytes``): what it reports covers every process below
  it, the other ranks of a job included.
- **usage**: the limiting group's bytes now (v2 ``memory.current``, v1 ``memory.usage_in_bytes``), and of them its
  anonymous memory and its dirty and under-writeback page cache (``memory.stat``, over its whole subtree); and the
  most it ever held (v2 ``memory.peak``, v1 ``memory.max_usage_in_bytes``), which shows a rise between two readings
  that was gone by the second.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

_UNLIMITED = 2**62  # cgroup v1 reports "no limit" as a number near 2**63


class Version(enum.Enum):
    """A cgroup hierarchy's version, and the names of its memory files."""

    V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes", ("total_rss",
          "total_shmem"), ("total_dirty", "total_writeback"))  # fmt: skip
    V2 = ("memory.max", "memory.current", "memory.peak", ("anon", "shmem"), ("file_dirty", "file_writeback"))

    def __init__(self, limit: str, usage: str, peak: str, anonymous: tuple[str, ...], dirty: tuple[str, ...]) -> None:
        self.limit = limit
        self.usage = usage
        self.peak = peak  # the largest usage so far (v2 since Linux 5.19)
        self.anonymous = anonymous  # ``memory.stat`` keys summed: memory no file backs (shared memory is pinned too)
        self.dirty = dirty  # ``memory.stat`` keys summed: page cache not yet on the disk


@dataclass(frozen=True)
class Usage:
    """What a memory group held at one reading, in bytes."""

    total: int  # everything charged to it: anonymous memory, page cache, kernel memory
    anonymous: int
    dirty: int  # page cache written and not yet on the disk, or being written
    peak: int  # the largest total so far (the total where the kernel does not say)

    @property
    def page_cache(self) -> int:
        """What it holds besides anonymous memory: the page cache, and the kernel's bookkeeping of both."""
        return max(self.total - self.anonymous, 0)


@dataclass(frozen=True)
class MemoryGroup:
    """The limiting group (see the module): its directory, its hierarchy's version and its limit."""

    path: Path
    version: Version
    limit: int

    def usage(self) -> Usage:
        """The group's usage now; reading it costs two small files."""
        stat: dict[str, int] = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stat[key] = int(value)
        total = int((self.path / self.version.usage).read_text())
        try:
            peak = int((self.path / self.version.peak).read_text())
        except OSError:
            peak = total
        return Usage(
            total=total,
            anonymous=sum(stat.get(key, 0) for key in self.version.anonymous),
            dirty=sum(stat.get(key, 0) for key in self.version.dirty),
            peak=peak,
        )


def limiting_group(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> MemoryGroup | None:
    """The group with the tightest memory limit over this process's memory group and its ancestors, in either
    hierarchy (v2 mounted at ``root`` or ``root``/unified, v1 at ``root``/memory); ``None`` where none has a limit
    or no cgroup can be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    groups = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            bases, version = [root, root / "unified"], Version.V2
        elif "memory" in controllers.split(","):
            bases, version = [root / "memory"], Version.V1
        else:
            continue
        for base in bases:
            group = base / path.lstrip("/")
            while group.is_relative_to(base):
                limit = _read_limit(group / version.limit)
                if limit is not None and limit < _UNLIMITED:
                    groups.append(MemoryGroup(group, version, limit))
                if group == base:
                    break
                group = group.parent
    return min(groups, key=lambda group: group.limit, default=None)


def memory_limit(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of the tightest memory limit over this process's memory group and its ancestors; ``None`` where there is
    none or no cgroup can be read."""
    group = limiting_group(proc, root)
    return None if group is None else group.limit


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)
