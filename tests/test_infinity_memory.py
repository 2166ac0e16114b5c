"""ZeRO-Infinity's host memory does not grow with the model: a rank's anonymous memory at two depths of the same model
differs by less than :data:`PER_ADDED_PARAMETER` bytes per added parameter (and so does its resident memory, file
pages included, whose peak the kernel keeps exactly where the anonymous one is sampled), and holds fewer than
:data:`UNITS_ALIVE` copies of the largest unit, for Lightning's demo Transformer (whose decoder layers all read the
encoder's output) and a stack of linear layers; likewise for a stack of ``Linear(1024)`` whose depths each run in
processes of their own (:data:`FRESH`); and a run inside a memory group whose limit counts the page cache trains
(where the machine lets a memory group be made)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests import memory_group
from tests.launch import launch
from tests.scenarios import read_results

pytestmark = pytest.mark.slow  # every test here launches processes

PER_ADDED_PARAMETER = 0.05  # bytes a rank
# What a rank holds of units at its peak, in fp32 copies of the largest unit's parameters: the unit gathered (its
# all-gather's output lies in the shared gather ring) and its gradients, or them and the copy the reduce-scatter sends,
# and a unit's part of the smaller ones (the root's). Measured 2.0 (MLP) and 2.35 (demo Transformer); 3.0 and 3.35
# while the CPU kept what ``fully_shard`` keeps for CUDA streams (an all-gather's output, a reduce-scatter's input).
UNITS_ALIVE = 2.5
# The anonymous peak is sampled (every 2 ms): a short peak missed in one run and caught in the other shows as a few MB
# (up to 3 MB seen on a loaded machine, 0.06 bytes a parameter here), so it gets twice the bound; before it was fixed
# it grew by 2.6 bytes a parameter.
SAMPLED_ANONYMOUS = 2 * PER_ADDED_PARAMETER
# First a small run, so that what a process sets up once (gloo's connections, torch's lazy modules) is in place
# before the measured runs; then each shape at two depths deep enough that the units gathered and read ahead at once
# are the same at both. A shallow and a deep run differ by 59 M and 50 M parameters: 0.05 bytes each is 2.9 and
# 2.5 MB, above the runs' noise (about 1 MB).
WARM_UP = "transformer:256:1"
PAIRS = [("transformer:1024:2", "transformer:1024:4"), ("mlp:4096:3", "mlp:4096:6")]


# Each depth in processes of their own, with nothing run before it: layers of 4 MiB (``Linear(1024)``'s weight), under
# the 32 MiB up to which glibc raises its mmap threshold, so that a run that fixes the threshold only after building
# the module (which allocates and frees each weight's storage) leaves the heap grown by the model's size. Measured:
# 0.05 and 0.07 bytes a parameter on the two ranks (the first backward's small blocks, left free between long-lived
# ones); 2.5 with the threshold fixed after building, as it was (whether the heap grows on a rank depends on timing).
FRESH = ("mlp:1024:16", "mlp:1024:64")
FRESH_PER_ADDED_PARAMETER = 0.25  # bytes a rank


def trained(out: Path, runs: list[str]) -> list[list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory(dir=out) as offload_dir:
        launch("tests.workers.infinity_memory", [str(out), offload_dir, *runs], world_size=2)
    return read_results(out, 2)


def test_anonymous_memory_does_not_grow_with_the_model(tmp_path: Path) -> None:
    ranks = trained(tmp_path, [WARM_UP, *(run for pair in PAIRS for run in pair)])
    for rank, results in enumerate(ranks):
        by_run = {result["run"]: result for result in results}
        for shallow, deep in PAIRS:
            a, b = by_run[shallow], by_run[deep]
            assert all(math.isfinite(loss) for loss in a["losses"] + b["losses"]), (a, b)
            added = b["params"] - a["params"]
            anonymous = (b["grew"] - a["grew"]) / added
            resident = (b["resident_grew"] - a["resident_grew"]) / added  # exact, file pages included
            assert resident < PER_ADDED_PARAMETER, (rank, shallow, deep, a, b, resident)
            assert anonymous < SAMPLED_ANONYMOUS, (rank, shallow, deep, a, b, anonymous)
            for run in (a, b):
                units = run["grew"] / (4 * run["largest_unit"])
                assert units < UNITS_ALIVE, (rank, run["run"], units)


def test_a_fresh_process_does_not_grow_with_the_model(tmp_path: Path) -> None:
    """The stack of ``Linear(1024)`` at two depths, each in processes that ran nothing before: a rank's anonymous
    memory grows by less than :data:`FRESH_PER_ADDED_PARAMETER` bytes per added parameter (see :data:`FRESH`)."""
    by_depth = []
    for run in FRESH:
        out = tmp_path / run.replace(":", "-")
        out.mkdir()
        by_depth.append([results for (results,) in trained(out, [run])])
    shallow, deep = by_depth
    for rank, (a, b) in enumerate(zip(shallow, deep, strict=True)):
        assert all(math.isfinite(loss) for loss in a["losses"] + b["losses"]), (a, b)
        anonymous = (b["grew"] - a["grew"]) / (b["params"] - a["params"])
        assert anonymous < FRESH_PER_ADDED_PARAMETER, (rank, a, b, anonymous)


@pytest.mark.skipif(memory_group.unavailable_reason() is not None, reason=str(memory_group.unavailable_reason()))
def test_trains_inside_a_memory_group(tmp_path: Path) -> None:
    """Two ranks of the demo Transformer under a limit that counts the page cache: they train (no OOM kill) with
    finite losses, the group's peak within the limit."""
    limit = 3 * 2**30 // 2
    with memory_group.joined(limit, name="lightning_zero_test") as group:
        ranks = trained(tmp_path, ["transformer:512:2"])
    assert group.oom_kills == 0 and 0 < group.peak <= limit, group
    for (result,) in ranks:
        assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"]), result
