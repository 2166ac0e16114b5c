"""A memory group (cgroup) to run processes under a hard memory limit that counts the page cache, as a cluster's job
limit does (SLURM's ``ConstrainRAMSpace``, a Kubernetes limit): cgroup v2 where its memory controller is mounted, v1
otherwise. Making one needs root.

:func:`made` makes a group for processes to :func:`enter`, and :func:`joined` moves the calling process into one for the
duration of a ``with`` block, so that the processes it starts there are in it (memory it held before stays charged where
it was); afterwards the group's peak usage (anonymous memory and page cache) and the OOM killer's kills in it are read,
and the group is removed. A group without a limit accounts the same, for a run to compare with.
:class:`AnonymousPeak` measures, in any process and without a group, the largest anonymous memory it held, and
:func:`resident_peak` the largest resident memory, exactly, since :func:`reset_resident_peak`; :func:`own_usage` tells
what the process's group uses now.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lightning_zero._offload.cgroup import MemoryGroup, Usage, Version
from tests import forkserver

CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Hierarchy:
    """Where a cgroup version's memory controller is mounted, and its files' names."""

    version: int
    root: Path
    limit: str  # the hard limit (page cache included)
    swap_limit: str | None  # memory and swap together (v1) or swap alone (v2); absent without swap accounting
    peak: str  # the largest usage since the group was made
    events: str  # where the OOM killer's kills are counted (an ``oom_kill N`` line)


V2 = Hierarchy(2, CGROUP, "memory.max", "memory.swap.max", "memory.peak", "memory.events")
V1 = Hierarchy(1, CGROUP / "memory", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes",
               "memory.max_usage_in_bytes", "memory.oom_control")  # fmt: skip


def hierarchy() -> Hierarchy | None:
    """The hierarchy a memory group can be made in, v2 first; ``None`` without root or without a memory controller."""
    if os.geteuid() != 0:
        return None
    for root in (CGROUP, CGROUP / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return Hierarchy(2, root, V2.limit, V2.swap_limit, V2.peak, V2.events)
    if (V1.root / V1.limit).exists():
        return V1
    return None


def unavailable_reason() -> str | None:
    """Why no memory group can be made here, or ``None`` when one can."""
    if os.geteuid() != 0:
        return "making a memory group (cgroup) needs root"
    if hierarchy() is None:
        return "no cgroup memory controller is mounted under /sys/fs/cgroup"
    return None


@dataclass
class GroupResult:
    """What a memory group saw, read as it was removed."""

    peak: int = 0  # bytes: its largest usage, anonymous memory and page cache
    oom_kills: int = 0


@contextmanager
def made(limit: int | None, name: str = "lightning_zero_bench") -> Iterator[tuple[Path, GroupResult]]:
    """A new memory group limited to ``limit`` bytes (swap included; ``None``: no limit), for processes to
    :func:`enter`; yields its directory and the :class:`GroupResult` filled in as the block ends."""
    found = hierarchy()
    if found is None:
        raise RuntimeError(f"No memory group can be made here: {unavailable_reason()}.")
    group = found.root / f"{name}-{os.getpid()}"
    if found.version == 2:
        (found.root / "cgroup.subtree_control").write_text("+memory")
    group.mkdir()
    result = GroupResult()
    try:
        if limit is not None:
            (group / found.limit).write_text(str(limit))
        if limit is not None and found.swap_limit is not None and (group / found.swap_limit).exists():
            (group / found.swap_limit).write_text(str(limit if found.version == 1 else 0))
        try:
            yield group, result
        finally:
            result.peak = int((group / found.peak).read_text())
            result.oom_kills = _counted(group / found.events, "oom_kill")
    finally:
        _remove(group)


def enter(group: Path) -> None:
    """Move the calling process into ``group``: what it allocates from now on is charged there (what it held before
    stays charged where it was)."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


@contextmanager
def joined(limit: int | None, name: str = "lightning_zero_bench") -> Iterator[GroupResult]:
    """A new memory group (see :func:`made`) with the calling process in it until the block ends, so that the
    processes it starts are in it; the yielded :class:`GroupResult` is filled in as the block ends."""
    found = hierarchy()
    assert found is not None or unavailable_reason() is not None
    home = _own_group(found) if found is not None else None
    with made(limit, name) as (group, result), forkserver.off():
        enter(group)
        try:
            yield result
        finally:
            assert home is not None
            enter(home)


def _own_group(found: Hierarchy) -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (found.version == 2 and controllers == "") or (found.version == 1 and "memory" in controllers.split(",")):
            return found.root / path.lstrip("/")
    raise RuntimeError("/proc/self/cgroup names no memory group of this process.")


def own_usage() -> Usage | None:
    """What this process's memory group uses now (the group :func:`joined` put it in, or the one it started in);
    ``None`` where no memory controller can be read."""
    found = hierarchy()
    if found is None:
        return None
    version = Version.V2 if found.version == 2 else Version.V1
    return MemoryGroup(_own_group(found), version, limit=0).usage()


def _counted(events: Path, name: str) -> int:
    """The count on the ``name N`` line of ``events``."""
    for line in events.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0



def _remove(group: Path) -> None:
    """Remove the group once its processes have ended (a killed rank's exit can take a moment to be accounted)."""
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    group.rmdir()


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): what it holds that no file backs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line.")


class AnonymousPeak:
    """This process's largest anonymous memory (``RssAnon``), sampled on a thread of its own every 2 ms."""

    INTERVAL = 0.002

    def __init__(self) -> None:
        self.start = self.peak = anonymous_bytes()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stopped.wait(self.INTERVAL):
            self.peak = max(self.peak, anonymous_bytes())

    def stop(self) -> int:
        self._stopped.set()
        self._thread.join()
        return max(self.peak, anonymous_bytes())


def reset_resident_peak() -> None:
    """Start this process's resident peak (``VmHWM``) over from its resident memory now (Linux 4.0 on)."""
    Path("/proc/self/clear_refs").write_text("5")


def resident_peak() -> int:
    """This process's largest resident memory (``VmHWM``: anonymous and file pages, as the kernel counts them at every
    change, so no short peak is missed) since it began or :func:`reset_resident_peak`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line.")
