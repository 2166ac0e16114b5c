"""The shared-memory collectives of CPU process groups (lightning_zero/_transport/): exact results against sums
computed from every rank's data, the stage-3 gather ring's hand-out rule, failures reported instead of hangs, nothing
left in /dev/shm by a rank killed while the files have names, and the strategies' parity with DDP when shared memory is
switched off (the point-to-point path of ranks on several hosts).

Exactness: the channel adds ranks' values in rank order, so results are compared with ``torch.equal`` against the same
sums done locally; gloo's own all-reduce (another order) only to rounding.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.oracle import compare_runs
from tests.scenarios import Scenario, SharedMemoryCheck, run_phase, run_scenarios, start_phase

pytestmark = pytest.mark.slow  # every test here launches processes


WORKER = "tests.workers.shared_memory"


def run_checks(check: SharedMemoryCheck, world_size: int, tmp_path: Path) -> list[list[str] | None]:
    """Each rank's passed checks; None for a rank that wrote none (one that exits on purpose)."""
    tmp_path.mkdir(exist_ok=True)
    run_phase(WORKER, check, tmp_path, world_size, timeout=120)
    files = [tmp_path / f"rank{r}.json" for r in range(world_size)]
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_are_exact_and_the_ring_is_handed_out_safely(world_size: int, tmp_path: Path) -> None:
    passed = run_checks(SharedMemoryCheck.COLLECTIVES, world_size, tmp_path)
    expected = [
        "opened, nothing left in /dev/shm",
        "all_gather, reduce_scatter, all_reduce: every dtype and size, several pieces",
        "collectives in flight together",
        "ring buffers handed out while free, slots when all held",
        "a buffer released on one rank only is not handed out",
    ]
    assert passed == [expected] * world_size


def test_a_peer_that_exits_is_reported_not_waited_for(tmp_path: Path) -> None:
    passed = run_checks(SharedMemoryCheck.PEER_EXIT, 2, tmp_path)
    assert passed[0] == ["a peer that exits is reported"]


def test_a_rank_that_never_arrives_is_reported_after_the_timeout(tmp_path: Path) -> None:
    passed = run_checks(SharedMemoryCheck.TIMEOUT, 2, tmp_path)
    assert passed[0] == ["a rank that never arrives is reported after the timeout"]


def named_shared_files(pid: int) -> set[Path]:
    """The files in /dev/shm that process ``pid`` maps or holds open and that still have their names."""
    paths = [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            paths.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    return {Path(p) for p in paths if p.startswith("/dev/shm/lightning_zero-") and not p.endswith(" (deleted)")}


def test_ranks_killed_while_shared_memory_opens_leave_nothing_after_the_next_run(tmp_path: Path) -> None:
    """Two runs, each with a rank 0 SIGKILLed in the window where its files in /dev/shm have names: it has created its
    segment and FIFO (the channel's opening), or stage 3's gather ring, and waits for rank 1, which never comes. The
    files stay behind; the next run's channel removes them, their creator being dead, and leaves nothing of its own.
    A run that opens while those ranks are still alive removes nothing of theirs."""
    # each window's files
    windows = {SharedMemoryCheck.CHANNEL_ALONE: {".seg", ".fifo"}, SharedMemoryCheck.RING_ALONE: {".ring"}}
    procs = {}
    for window in windows:
        (tmp_path / window.value).mkdir()
        procs[window] = start_phase(WORKER, window, tmp_path / window.value, 2, logs=tmp_path / window.value)
    try:
        deadline = time.monotonic() + 60
        held: dict[SharedMemoryCheck, set[Path]] = {window: set() for window in windows}
        while any({path.suffix for path in held[w]} != suffixes for w, suffixes in windows.items()):
            for window, (rank_0, _) in procs.items():
                running = time.monotonic() < deadline and rank_0.poll() is None
                assert running, (tmp_path / window.value / "rank0.log").read_text()
                held[window] = named_shared_files(rank_0.pid)
            time.sleep(0.05)
        left = set().union(*held.values())
        assert run_checks(SharedMemoryCheck.OPEN, 2, tmp_path / "beside") == [["opened, nothing left in /dev/shm"]] * 2
        assert all(path.exists() for path in left), "a live run's files were removed"
    finally:
        for proc in [p for pair in procs.values() for p in pair]:
            proc.kill()
            proc.wait()
    assert all(path.exists() for path in left), left  # what the kills left
    assert run_checks(SharedMemoryCheck.OPEN, 2, tmp_path / "next") == [["opened, nothing left in /dev/shm"]] * 2
    assert not [path for path in left if path.exists()]


def test_strategies_match_ddp_through_point_to_point_exchanges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With shared memory off, gloo groups use this package's point-to-point exchanges, as across hosts."""
    monkeypatch.setenv("LIGHTNING_ZERO_SHM_DISABLE", "1")
    scenarios = [
        Scenario("adam", strategies=["ddp", "zero1", "zero2"]),
        Scenario("tied", module="tied_lm", strategies=["ddp", "zero3"]),
    ]
    results = run_scenarios(scenarios, 2, tmp_path)
    for spec in scenarios:
        for strategy in spec.compared:
            compare_runs(results, spec, strategy)
