"""The test launcher stops every rank on the first failure, and at its timeout, instead of waiting on a blocked
rank; it names the failing rank and shows its error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.launch import GRACE, LaunchError, Probe
from tests.scenarios import run_phase

pytestmark = pytest.mark.slow  # every test here launches processes

PROBE = "tests.workers.launch_probe"


def assert_gone(pid_file: Path) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_failing_rank_stops_the_blocked_ones(tmp_path: Path) -> None:
    """Rank 1 raises while rank 0 waits for it in the process group's rendezvous (which would wait 30 minutes):
    the launcher raises a few seconds later, naming rank 1 and its error, with rank 0 killed."""
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)processes failed \[\(1, 1\)\]; ranks \[0\] were killed.*"
                       r"--- rank 0 \(killed by the launcher\) ---.*--- rank 1 \(exit code 1\) ---.*"
                       r"RuntimeError: rank 1 gives up at once"):  # fmt: skip
        run_phase(PROBE, Probe.RANK1_FAILS, tmp_path, world_size=2, timeout=300)
    assert time.monotonic() - start < GRACE + 20
    assert_gone(tmp_path / "rank0.pid")


def test_ranks_past_the_timeout_are_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] were still running after 2 s, and were killed"):
        run_phase(PROBE, Probe.ALL_BLOCK, tmp_path, world_size=2, timeout=2)
    assert time.monotonic() - start < 15
    for rank in range(2):
        assert_gone(tmp_path / f"rank{rank}.pid")


def test_outputs_of_a_successful_launch(tmp_path: Path) -> None:
    assert run_phase(PROBE, Probe.SUCCEED, tmp_path, world_size=3) == [f"rank {r} done\n" for r in range(3)]
