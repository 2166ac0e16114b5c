"""The offload files' page cache: the memory group read from cgroup trees of either version, the budgets of the
``page_cache`` option, ranges leaving the process and the page cache within a budget (residency observed with
``mincore``) with their data kept, a real memory group's budget, and the option in both front ends."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

import lightning_zero
from lightning_zero._config import ZeroConfig
from lightning_zero._files import nameless_mapping
from lightning_zero._offload.allocator import return_large_blocks
from lightning_zero._offload.cgroup import MemoryGroup, Usage, Version, limiting_group, memory_limit
from lightning_zero._offload.page_cache import (
    Excess,
    Fixed,
    GroupRoom,
    Held,
    PageCache,
    budget_for,
)
from lightning_zero._offload.target import memory_filesystem
from lightning_zero._offload.writeback import MappedFile, Writeback
from lightning_zero.fabric import Zero3Strategy as FabricZero3Strategy
from tests import memory_group
from tests.residency import resident_bytes
from tests.workers import page_cache as page_cache_worker

GIB = 2**30
MIB = 2**20


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


# --- the memory group, from cgroup trees ------------------------------------------------------------------------------


def test_memory_limit_is_the_tightest_over_the_group_and_its_ancestors(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/job/step\n0::/\n")
    _tree(tmp_path, {
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "memory/job/memory.limit_in_bytes": str(6 * GIB),
        "memory/job/step/memory.limit_in_bytes": str(8 * GIB),
    })  # fmt: skip
    assert memory_limit(proc, tmp_path) == 6 * GIB
    assert limiting_group(proc, tmp_path) == MemoryGroup(tmp_path / "memory/job", Version.V1, 6 * GIB)
    proc.write_text("0::/slice/job\n")
    _tree(tmp_path, {"slice/memory.max": "max", "slice/job/memory.max": str(3 * GIB)})
    assert limiting_group(proc, tmp_path) == MemoryGroup(tmp_path / "slice/job", Version.V2, 3 * GIB)
    (tmp_path / "slice/job/memory.max").write_text("max")
    assert memory_limit(proc, tmp_path) is None  # "max" everywhere: no limit
    assert memory_limit(tmp_path / "missing", tmp_path) is None


def test_usage_is_read_from_the_limiting_group_of_either_version(tmp_path: Path) -> None:
    """Usage, anonymous memory (shared memory with it: it cannot be dropped), dirty pages over the subtree, and the
    peak (the usage where the kernel keeps none)."""
    _tree(tmp_path, {
        "v1/memory.usage_in_bytes": str(5 * GIB),
        "v1/memory.max_usage_in_bytes": str(7 * GIB),
        "v1/memory.stat": f"cache 7\nrss 9\ntotal_cache {3 * GIB}\ntotal_rss {GIB}\ntotal_shmem {GIB // 2}\n"
                          f"total_dirty {GIB // 4}\ntotal_writeback {GIB // 8}\n",
        "v2/memory.current": str(5 * GIB),
        "v2/memory.peak": str(7 * GIB),
        "v2/memory.stat": f"anon {GIB}\nfile {3 * GIB}\nshmem {GIB // 2}\nfile_dirty {GIB // 4}\n"
                          f"file_writeback {GIB // 8}\n",
    })  # fmt: skip
    expected = Usage(total=5 * GIB, anonymous=GIB + GIB // 2, dirty=GIB // 4 + GIB // 8, peak=7 * GIB)
    for version in Version:
        usage = MemoryGroup(tmp_path / version.name.lower(), version, 6 * GIB).usage()
        assert usage == expected, version
        assert usage.page_cache == 5 * GIB - GIB - GIB // 2
    (tmp_path / "v2/memory.peak").unlink()  # before Linux 5.19
    assert MemoryGroup(tmp_path / "v2", Version.V2, 6 * GIB).usage().peak == 5 * GIB


# --- the budgets ---------------------------------------------------------------------------------------------------


def test_auto_is_the_group_budget_only_under_a_limit_below_the_machine(tmp_path: Path) -> None:
    group = MemoryGroup(tmp_path, Version.V2, 6 * GIB)
    assert isinstance(budget_for(PageCache.AUTO, group, physical=24 * GIB), GroupRoom)
    assert budget_for(PageCache.AUTO, group, physical=6 * GIB) is None  # a limit the machine cannot reach
    assert budget_for(PageCache.AUTO, None, physical=24 * GIB) is None
    assert budget_for(PageCache.KEEP, group, physical=24 * GIB) is None
    assert budget_for(PageCache.DROP, None, physical=24 * GIB) == Fixed(0)
    assert budget_for(GIB, group, physical=24 * GIB) == Fixed(GIB)


def test_group_room_learns_the_working_set_and_shares_the_rest(tmp_path: Path) -> None:
    """The group's room is its limit less the largest anonymous usage read and a headroom: 1/16 of the limit, or the
    most the usage rose above one reading before the next (the group's peak shows it) if more. A rank's share of it,
    less the most it mapped of the files at once, holds its ranges and what it reads ahead: beyond it the oldest are
    dropped (making room for pages about to be read ahead), beyond all of it but the rank's part of a second
    headroom dirty ones written back; over the group's room a rank waits for its writebacks. Until a first step has
    ended it keeps nothing that left."""

    def read(total: float, anonymous: float, dirty: float, peak: float) -> None:
        _tree(tmp_path, {
            "memory.current": str(int(total * GIB)),
            "memory.peak": str(int(peak * GIB)),
            "memory.stat": f"anon {int(anonymous * GIB)}\nfile_dirty {int(dirty * GIB)}\nfile_writeback 0\n",
        })  # fmt: skip

    def gib(value: float) -> int:
        return int(value * GIB)

    mapped = [GIB]  # the libraries' pages, mapped before any file
    room = GroupRoom(MemoryGroup(tmp_path, Version.V2, 16 * GIB), ranks=2, mapped=lambda: mapped[0])
    nothing = Held(cached=0, dirty=0, writing=0, dropping=0)
    read(total=5, anonymous=3, dirty=1, peak=5)
    first = Held(cached=GIB, dirty=GIB, writing=0, dropping=0, reading=0)
    assert room.excess(first) == Excess(drop=GIB, write=GIB)  # the first step keeps nothing that left...
    assert room.admits(first, incoming=8 * GIB)  # ...and reads ahead, as "drop" does
    room.step_ended()
    assert room.excess(nothing) == Excess()
    assert (room.headroom, room.room(), room.share()) == (GIB, 12 * GIB, 6 * GIB)
    read(total=6, anonymous=4, dirty=1, peak=8)  # between the readings the usage rose 3 GiB above the first
    mapped[0] = 2 * GIB  # and this rank works on 1 GiB of the files
    held = Held(cached=3 * GIB, dirty=gib(2.5), writing=0, dropping=0, reading=GIB)
    # a share of 4.5, less 1 in use: 3.5; dirty up to it less half the headroom (3 GiB over 2 ranks): 2
    assert room.excess(held) == Excess(drop=gib(0.5), write=gib(0.5))
    assert (room.headroom, room.room(), room.share()) == (3 * GIB, 9 * GIB, gib(3.5))
    assert room.excess(held, incoming=GIB).drop == gib(1.5)
    assert room.admits(held, incoming=2 * GIB) and not room.admits(held, incoming=3 * GIB)
    read(total=5, anonymous=2, dirty=1, peak=8)
    mapped[0] = GIB  # the working set shrank, and this rank maps less: their peaks still count
    assert room.excess(held) == Excess(drop=gib(0.5), write=gib(0.5)) and room.share() == gib(3.5)
    read(total=14, anonymous=2, dirty=1, peak=14)  # rose 9 GiB: the room is 3, the page cache 12
    assert room.excess(nothing) == Excess(over=9 * GIB) and room.share() == gib(0.5)


def test_a_fixed_budget_counts_this_ranks_ranges() -> None:
    held = Held(cached=5 * MIB, dirty=3 * MIB, writing=MIB, dropping=MIB)
    assert Fixed(8 * MIB).excess(held) == Excess()
    assert Fixed(4 * MIB).excess(held) == Excess(drop=MIB, write=MIB)
    assert Fixed(0).excess(held) == Excess(drop=5 * MIB, write=3 * MIB)


# --- ranges in files: what stays in the page cache --------------------------------------------------------------------


@pytest.fixture
def on_disk(tmp_path: Path) -> Path:
    """``tmp_path``, where a dropped page leaves memory: not on a filesystem that lives in it."""
    if memory_filesystem(tmp_path) is not None:
        pytest.skip(f"{tmp_path} is on {memory_filesystem(tmp_path)}, whose pages stay in memory once dropped")
    return tmp_path


def _left(directory: Path, writeback: Writeback, count: int) -> list[MappedFile]:
    """``count`` files of 1 MiB, each filled with its index and leaving the process written, oldest first."""
    files = [MappedFile(*nameless_mapping(directory, MIB)) for _ in range(count)]
    for index, file in enumerate(files):
        torch.frombuffer(file.mapping, dtype=torch.float32).fill_(index)
        writeback.leave(file, 0, MIB, written=True)
    return files


def _cached(files: list[MappedFile]) -> list[int]:
    return [resident_bytes(file.fd, 0, MIB) // MIB for file in files]  # whole MiB: each file all in or all out


def _intact(files: list[MappedFile]) -> None:
    for index, file in enumerate(files):
        assert torch.equal(torch.frombuffer(file.mapping, dtype=torch.float32), torch.full((MIB // 4,), index)), index


@pytest.mark.parametrize(
    ("budget", "cached"),
    [
        (None, [1, 1, 1, 1, 1, 1]),  # "keep": the kernel keeps what it has room for
        (Fixed(100 * MIB), [1, 1, 1, 1, 1, 1]),  # a roomy budget keeps everything
        (Fixed(3 * MIB), [0, 0, 0, 1, 1, 1]),  # a tight one the newest
        (Fixed(0), [0, 0, 0, 0, 0, 0]),  # "drop": nothing
    ],
    ids=["keep", "roomy", "tight", "drop"],
)
def test_ranges_stay_cached_within_the_budget_and_the_oldest_go(
    on_disk: Path, budget: Fixed | None, cached: list[int]
) -> None:
    """Each range leaves the process at once; the page cache then keeps the newest within the budget, the oldest
    dropped (a written one once written back), and every file keeps its data."""
    writeback = Writeback(budget, under_way=2 * MIB)
    files = _left(on_disk, writeback, 6)
    writeback.drain()
    assert _cached(files) == cached
    for file in files:  # left the process: its mapping holds no page
        assert _mapped_resident(file) == 0
    _intact(files)


def _mapped_resident(file: MappedFile) -> int:
    """Resident bytes of the process's own mapping of ``file`` (/proc/self/smaps)."""
    start = torch.frombuffer(file.mapping, dtype=torch.uint8).data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = int(fields[0].split("-")[0], 16) == start
        elif inside and fields[0] == "Rss:":
            return int(fields[1]) * 1024
    raise AssertionError("no such mapping")


def test_a_range_read_ahead_outlives_older_ones(on_disk: Path) -> None:
    """The budget drops the least recently used: a range read ahead is in use until it leaves again, as the newest,
    and one that was to be dropped once written back stays."""
    writeback = Writeback(Fixed(2 * MIB), under_way=4 * MIB)
    first, second = _left(on_disk, writeback, 2)
    writeback.read_ahead(first, 0, MIB)
    assert writeback.held.cached == MIB  # the second alone: the first is in use
    writeback.leave(first, 0, MIB, written=False)
    (third,) = _left(on_disk, writeback, 1)
    writeback.drain()
    assert _cached([first, second, third]) == [1, 0, 1]
    writeback = Writeback(Fixed(0), under_way=4 * MIB)
    (going,) = _left(on_disk, writeback, 1)  # its writeback is under way: dropped once it is done...
    writeback.read_ahead(going, 0, MIB)  # ...unless read again first
    writeback.drain()
    assert _cached([going]) == [1]


def test_parts_of_a_range_and_writes_during_its_writeback_are_counted(on_disk: Path) -> None:
    """A range left in parts splits the one kept for it, and a whole one merges them (dirty if any part was); a range
    written again while its writeback runs stays dirty when that writeback ends."""
    writeback = Writeback(Fixed(100 * MIB))
    file = MappedFile(*nameless_mapping(on_disk, 4 * MIB))
    writeback.leave(file, 0, 4 * MIB, written=True)
    writeback.leave(file, MIB, MIB, written=False)
    assert writeback.held == Held(cached=4 * MIB, dirty=4 * MIB, writing=0, dropping=0)
    writeback.leave(file, 0, 4 * MIB, written=False)
    assert writeback.held == Held(cached=4 * MIB, dirty=4 * MIB, writing=0, dropping=0)
    writeback.budget = Fixed(0)
    writeback.leave(file, 0, 4 * MIB, written=False)  # over the budget: its writeback starts
    assert writeback.held == Held(cached=0, dirty=0, writing=4 * MIB, dropping=4 * MIB)
    writeback.budget = Fixed(100 * MIB)
    writeback.leave(file, 0, 4 * MIB, written=True)  # written again before that writeback is waited for
    writeback.drain()
    assert writeback.held == Held(cached=4 * MIB, dirty=4 * MIB, writing=0, dropping=0)


def test_allocator_setting_takes_on_glibc() -> None:
    assert return_large_blocks() is (platform.libc_ver()[0] == "glibc")


# --- a real memory group ----------------------------------------------------------------------------------------------


def _in_group(limit: int, directory: Path, out: Path, count: int, size: int) -> tuple[dict, memory_group.GroupResult]:
    with memory_group.made(limit, name="lightning_zero_test") as (group, result):
        assert page_cache_worker.forked(group, directory, count, size, out) == 0
    return json.loads(out.read_text()), result


@pytest.mark.slow  # writes 512 MiB
@pytest.mark.skipif(memory_group.unavailable_reason() is not None, reason=str(memory_group.unavailable_reason()))
def test_pages_leave_the_cache_under_a_tight_group_and_stay_under_a_roomy_one(on_disk: Path) -> None:
    """A process writes 32 files of 8 MiB inside a memory group, under the ``"auto"`` budget: in a group whose limit
    leaves less room than that, the oldest files leave the page cache and the newer ones stay, within the room the
    group's own readings give; in one with room for them all, every page stays. The roomy group never reaches its
    limit; the tight one may touch it where the disk lags behind the writes (seen once in a CI run: the kernel then
    reclaims clean pages itself), but no process is killed, and every file keeps its data."""
    count, size = 32, 8 * MIB
    tight, tight_group = _in_group(128 * MIB, on_disk, on_disk / "tight.json", count, size)
    roomy, roomy_group = _in_group(GIB, on_disk, on_disk / "roomy.json", count, size)
    assert all(tight["intact"]) and all(roomy["intact"])
    assert 4 * size < tight["room"] < (count - 4) * size, tight  # the tight group's room holds some files, not all
    assert roomy["room"] > count * size, roomy
    resident = tight["resident"]
    gone = resident.index(size)  # the oldest went, then every newer one stayed
    assert gone > 0 and resident == [0] * gone + [size] * (count - gone), resident
    assert sum(resident) <= tight["room"] + size, (resident, tight["room"])
    assert roomy["resident"] == [size] * count, roomy["resident"]
    assert tight_group.oom_kills == roomy_group.oom_kills == 0
    assert tight["peak"] <= 128 * MIB and roomy["peak"] < GIB, (tight["peak"], roomy["peak"])


# --- the option -------------------------------------------------------------------------------------------------------


def test_page_cache_option_in_both_front_ends_a_deepspeed_config_and_a_cli_config(tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from tests.workers.modules import Classifier

    disk = {"offload_parameters": "disk", "offload_dir": tmp_path}
    assert lightning_zero.Zero3Strategy(**disk).config.page_cache is PageCache.AUTO
    assert lightning_zero.Zero3Strategy(**disk, page_cache="keep").config.page_cache is PageCache.KEEP
    assert FabricZero3Strategy(**disk, page_cache="drop").config.page_cache is PageCache.DROP
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    deepspeed = {"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}
    strategy = lightning_zero.Zero3Strategy.from_deepspeed_config(deepspeed, page_cache=GIB)
    assert strategy.config.page_cache == GIB
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
        f"    class_path: lightning_zero.Zero3Strategy\n    init_args:\n      offload_parameters: disk\n"
        f"      offload_dir: {tmp_path}\n      page_cache: {2 * GIB}\n"
    )
    cli = LightningCLI(Classifier, run=False, args=["--config", str(config)])
    assert cli.trainer.strategy.config.page_cache == 2 * GIB


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"page_cache": "never"}, "`page_cache='never'` is not a page-cache budget. HINT: pass 'auto'"),
        ({"page_cache": -1}, "`page_cache=-1` is not a page-cache budget"),
        ({"page_cache": True}, "`page_cache=True` is not a page-cache budget"),
        ({"page_cache": 1.5e9}, "`page_cache=1500000000.0` is not a page-cache budget"),
        ({"page_cache": "keep", "offload_dir": None, "offload_parameters": True},
         "`page_cache='keep'` budgets the page cache of the offload files, and nothing is offloaded to disk here."
         " HINT: pass `offload_optimizer='disk'`"),
    ],
)  # fmt: skip
def test_page_cache_option_is_checked(tmp_path: Path, options: dict, message: str) -> None:
    given = {"stage": 3, "offload_parameters": "disk", "offload_dir": tmp_path, **options}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        ZeroConfig.from_options(**given)
