"""The offload files' page cache (``_offload/page_cache.py``) on its own: the memory limit read from a cgroup tree of
either version, the policy it gives, and ranges leaving the process (and under a limit the page cache) with their
data kept in the file. No processes."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from lightning_zero._files import nameless_mapping
from lightning_zero._offload.allocator import return_large_blocks
from lightning_zero._offload.page_cache import MappedFile, PageCache, Writeback, memory_limit

GIB = 2**30


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_memory_limit_is_the_tightest_over_the_group_and_its_ancestors(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/job/step\n0::/\n")
    _tree(tmp_path, {
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "memory/job/memory.limit_in_bytes": str(6 * GIB),
        "memory/job/step/memory.limit_in_bytes": str(8 * GIB),
    })  # fmt: skip
    assert memory_limit(proc, tmp_path) == 6 * GIB
    proc.write_text("0::/slice/job\n")
    _tree(tmp_path, {"slice/memory.max": "max", "slice/job/memory.max": str(3 * GIB)})
    assert memory_limit(proc, tmp_path) == 3 * GIB
    (tmp_path / "slice/job/memory.max").write_text("max")
    assert memory_limit(proc, tmp_path) is None  # "max" everywhere: no limit
    assert memory_limit(tmp_path / "missing", tmp_path) is None


def _resident(mapping_start: int) -> int:
    """Resident bytes of the mapping that starts at ``mapping_start`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = int(fields[0].split("-")[0], 16) == mapping_start
        elif inside and fields[0] == "Rss:":
            return int(fields[1]) * 1024
    raise AssertionError("no such mapping")


def test_written_ranges_leave_and_keep_their_data(tmp_path: Path) -> None:
    """Under either policy a range leaves the process with its data kept in the file; under ``DROPPED`` written
    ranges wait for their writeback once more than the budget is under way, and ``drain`` waits for all."""
    for policy in PageCache:
        writeback = Writeback(policy, budget=3 * 2**20)
        files = [MappedFile(*nameless_mapping(tmp_path, 2**20)) for _ in range(5)]
        for index, file in enumerate(files):
            values = torch.frombuffer(file.mapping, dtype=torch.float32)
            values.fill_(index)
            writeback.leave(file, 0, 2**20, written=True)
            assert _resident(values.data_ptr()) == 0, policy
            assert writeback._bytes <= writeback.budget, policy
        writeback.drain()
        assert writeback._bytes == 0 and not writeback._under_way
        for index, file in enumerate(files):
            assert torch.equal(torch.frombuffer(file.mapping, dtype=torch.float32), torch.full((2**18,), index))


def test_allocator_setting_takes_on_glibc() -> None:
    assert return_large_blocks() is (platform.libc_ver()[0] == "glibc")
