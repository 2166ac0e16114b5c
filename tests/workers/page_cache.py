"""Runs in a process forked from the test (the package already imported, so that the group charges only what this
writes): moves into a memory group, writes ``count`` nameless files of ``size`` bytes each under a directory through
their mappings, each leaving the process through a :class:`Writeback` with the ``"auto"`` page-cache budget as soon
as it is written, then records which of them the page cache still holds (``mincore``), the group's peak usage,
whether each holds what was written at its ends, and the budget's room, for tests/test_page_cache.py. No torch: a
forked child had better not start its thread pools."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_zero._files import nameless_mapping
from lightning_zero._offload.page_cache import GroupRoom, PageCache, this_process_budget
from lightning_zero._offload.writeback import MappedFile, Writeback
from tests import memory_group
from tests.residency import resident_bytes


def fill_and_leave(group: Path, directory: Path, count: int, size: int, out: Path) -> None:
    """In the forked child: the run described above, its record written to ``out``."""
    memory_group.enter(group)
    budget = this_process_budget(PageCache.AUTO)
    assert isinstance(budget, GroupRoom), budget  # a limit below the machine's memory: the group's room
    budget.step_ended()  # as after a first step: this process's working set is what it has now
    writeback = Writeback(budget)
    files = []
    for index in range(count):
        file = MappedFile(*nameless_mapping(directory, size))
        file.mapping[:] = bytes([index]) * size
        writeback.leave(file, 0, size, written=True)
        files.append(file)
    writeback.drain()
    resident = [resident_bytes(file.fd, 0, size) for file in files]
    peak = budget.group.usage().peak  # before the reads below bring pages back (the kernel reads around them)
    intact = [file.mapping[0] == file.mapping[size - 1] == index for index, file in enumerate(files)]
    out.write_text(json.dumps({"resident": resident, "intact": intact, "room": budget.room(), "peak": peak}))


def forked(group: Path, directory: Path, count: int, size: int, out: Path) -> int:
    """:func:`fill_and_leave` in a forked child; its exit status (0: done)."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            fill_and_leave(group, directory, count, size, out)
            status = 0
        finally:
            os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
