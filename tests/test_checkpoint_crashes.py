"""A save killed (SIGKILL, from inside) at every step of writing and publishing a checkpoint over an existing one.

The guarantee under test: the checkpoint's path names one complete checkpoint, the old or the new, at every instant,
and which one is fixed by the step (before the swap or first rename: the old; after it: the new; between the two
renames of a filesystem that cannot swap, the kept copy, which the loader reads and the next save moves back); the
next save to the path works and leaves nothing behind. The kill leaves what it leaves; nothing runs after it. One
worker process trains once and forks a child per case, which dies in its save (tests/workers/checkpoint_faults.py).
"""

from __future__ import annotations

import json
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import consolidate_checkpoint
from tests.scenarios import FaultPhase, run_phase
from tests.workers.checkpoint_faults import LATER_STEPS, NEW_STEPS, OLD_STEPS, PUBLISH_STEPS, case_target

pytestmark = pytest.mark.slow  # every test here launches processes

WORKER = "tests.workers.checkpoint_faults"
CASES = [(swap, step) for swap, steps in PUBLISH_STEPS.items() for step in steps]
STEPS = {"old": OLD_STEPS, "new": NEW_STEPS}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per case, a checkpoint, then a process that died saving a later one over it."""
    out = tmp_path_factory.mktemp("killed")
    run_phase(WORKER, FaultPhase.KILL_DURING_PUBLISH, out, world_size=1)
    signals = json.loads((out / "signals.json").read_text())
    assert signals == {f"{swap}/{step}": signal.SIGKILL for swap, step in CASES}  # each died there, of nothing else
    refused = [(swap, step) for swap, step in CASES if (case_target(out, swap, step).parents[1] / "refused").exists()]
    assert refused == [(swap, step) for swap, step in CASES if swap == "two_renames"]  # the swap was refused there
    return out


@pytest.fixture(scope="module")
def resumed(killed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Consolidated right after the kill, then resumed by a new process that trains on and saves over it."""
    after_kill, warned = {}, {}
    for swap, step in CASES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output = consolidate_checkpoint(case_target(killed, swap, step), killed / "at-kill.ckpt")
        warned[swap, step] = [str(w.message) for w in caught if "stopped between two renames" in str(w.message)]
        after_kill[swap, step] = torch.load(output)
        output.unlink()
    report = tmp_path_factory.mktemp("resumed")
    targets = [case_target(killed, swap, step) for swap, step in CASES]
    run_phase(WORKER, FaultPhase.RESUME_AND_SAVE, report, world_size=1, paths=targets)
    return {"after_kill": after_kill, "warned": warned, "steps": json.loads((report / "resumed.json").read_text())}


@pytest.mark.parametrize(("swap", "step"), CASES)
def test_a_killed_publish_leaves_one_complete_checkpoint(
    killed: Path, resumed: dict[str, Any], swap: str, step: str
) -> None:
    """Right after the kill, loading the path (consolidating: every file checked against its checksum) gives the
    checkpoint the step says, bit for bit, whatever else lies beside it."""
    expected = PUBLISH_STEPS[swap][step]
    checkpoint = resumed["after_kill"][swap, step]
    assert checkpoint["global_step"] == STEPS[expected]
    truth = torch.load(killed / f"{expected}.pt")
    for key, value in truth.items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    other = torch.load(killed / ("new.pt" if expected == "old" else "old.pt"))
    assert not torch.equal(other["mid.weight"], truth["mid.weight"])  # the two could be told apart
    # only between the two renames is nothing at the path: the kept copy is loaded, and the loader says so
    assert len(resumed["warned"][swap, step]) == (step == "between_renames")


@pytest.mark.parametrize(("swap", "step"), CASES)
def test_the_save_after_a_killed_publish_recovers_and_leaves_nothing_behind(
    killed: Path, resumed: dict[str, Any], swap: str, step: str
) -> None:
    target = case_target(killed, swap, step)
    assert resumed["steps"][str(target)] == STEPS[PUBLISH_STEPS[swap][step]]  # `fit(ckpt_path=...)` found that one
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint"]
    saved = torch.load(consolidate_checkpoint(target, killed / "after.ckpt"))
    assert saved["global_step"] == LATER_STEPS


def test_a_save_killed_while_writing_keeps_the_old_checkpoint_and_the_next_save_reclaims_its_files(
    tmp_path: Path,
) -> None:
    """Two ranks die right after writing their shard files over an existing checkpoint: the old one stays, the
    half-written staging directory too, and the next save to the path removes it."""
    with pytest.raises(RuntimeError, match=r"processes failed \[\(0, -9\), \(1, -9\)\]"):  # -9: SIGKILL
        run_phase(WORKER, FaultPhase.KILL_DURING_WRITE, tmp_path, world_size=2)
    target = tmp_path / "checkpoints" / "checkpoint"
    leftovers = [p.name for p in target.parent.iterdir() if p.name != "checkpoint"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".checkpoint.partial"), leftovers
    assert sorted(p.name for p in (target.parent / leftovers[0]).iterdir()) == ["__0_0.distcp", "__1_0.distcp"]
    old = torch.load(consolidate_checkpoint(target, tmp_path / "old.ckpt"))
    assert old["global_step"] == OLD_STEPS
    for key, value in torch.load(tmp_path / "old.pt").items():
        assert torch.equal(old["state_dict"][key], value), key
    run_phase(WORKER, FaultPhase.RESUME_AND_SAVE, tmp_path, world_size=2, paths=[target])
    assert json.loads((tmp_path / "resumed.json").read_text()) == {str(target): OLD_STEPS}
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint"]
