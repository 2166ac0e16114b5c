"""Preemption on SLURM (tests/workers/preemption.py on 2 CPU ranks posing as the tasks of one SLURM job): the requeue
signal (SIGUSR1) sent to the ranks at each point of a step, Lightning's ``hpc_ckpt`` saved for it and the requeue
through ``scontrol`` (a script on ``PATH`` here that records its arguments), then the resumed job; and SIGTERM or an
exception with ``OnExceptionCheckpoint``. Every resumed run must end with the weights of a run never interrupted,
under every stage; ``"ddp"`` is run at the same moments for comparison.

Exact equality is the oracle: the resumed run and the uninterrupted one compute the same steps on the same ranks,
data and reduction order from the same weights and optimizer state, so any difference is a step lost or repeated.
A save killed half-way is a process that begins one and exits (its staging directory stays, as SLURM's kill after
the signal's grace time leaves it). Cost: one launch of 2 ranks, 37 short fits, about 2 minutes on the loaded 2-core
development machine.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.launch import launch, write_payload
from tests.scenarios import Preemption
from tests.workers.preemption import SIGNAL_AT

pytestmark = pytest.mark.slow  # launches processes

SLURM_JOB = "4242"
SIGUSR1 = [p for p in Preemption if p.value.startswith("sigusr1")]
CASES = [(stage, p) for stage in ("zero1", "zero2", "zero3") for p in Preemption if stage == "zero3" or p in (
    Preemption.AFTER_STEP, Preemption.RANK1_ONLY, Preemption.SIGTERM)]
DDP_CASES = [("ddp", Preemption.BEFORE_BACKWARD), ("ddp", Preemption.AFTER_STEP), ("ddp", Preemption.SIGTERM)]


def slurm_environment(tmp_path: Path) -> dict[str, str]:
    """The variables Lightning's ``SLURMEnvironment`` reads (one node, 2 tasks; each rank adds its own task ids), and
    an ``scontrol`` first on ``PATH`` that appends its arguments to ``tmp_path/scontrol.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": SLURM_JOB,
        "SLURM_JOB_NAME": "preemption-test",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1",
    }


def resumed_at(preemption: Preemption) -> int:
    """The step a resumed run starts from: the one after the signal's step, which the deferred checkpoint (or the
    SIGTERM's exception at the next step's start) comes before; a save's signal comes once step ``SIGNAL_AT`` has
    already been counted; the exception's checkpoint is of the step it interrupted, not yet taken."""
    return SIGNAL_AT if preemption in (Preemption.DURING_SAVE, Preemption.EXCEPTION) else SIGNAL_AT + 1


def test_a_preempted_run_resumes_exactly_under_every_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in slurm_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    write_payload(tmp_path, cases=CASES + DDP_CASES)
    launch("tests.workers.preemption", [str(tmp_path)], 2)
    results = json.loads((tmp_path / "results.json").read_text())
    for case, result in results.items():
        print(f"{case}: resumed at step {result['resumed_at']}, weights differ by {result['max_diff']:.3g} from a run"
              " never interrupted")
    for stage, preemption in CASES:
        result = results[f"{stage} {preemption.value}"]
        assert result["max_diff"] == 0.0, (stage, preemption, result)
        assert result["resumed_at"] == resumed_at(preemption), (stage, preemption, result)
        assert result["losses"] == result["uninterrupted_losses"][result["resumed_at"]:], (stage, preemption, result)
        assert result["saved"] == (["hpc_ckpt_1.ckpt"] if preemption in SIGUSR1 else []), (stage, preemption, result)
        assert result["hidden"] == [], (stage, preemption, result)  # no staging directory left, nor a dead save's
    requeues = (tmp_path / "scontrol.log").read_text().splitlines()
    assert requeues == [f"requeue {SLURM_JOB}"] * sum(p in SIGUSR1 for _, p in CASES + DDP_CASES)
    # "ddp" saves where the signal lands: after the optimizer stepped and before Lightning counted the step, the
    # weights of step SIGNAL_AT + 1 with the counters of step SIGNAL_AT, so the resumed run takes that step twice
    assert results[f"ddp {Preemption.BEFORE_BACKWARD.value}"]["max_diff"] == 0.0
    assert results[f"ddp {Preemption.AFTER_STEP.value}"]["max_diff"] > 1e-3
