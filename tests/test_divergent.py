"""Code that differs between ranks under ZeRO stage 3, with Hugging Face's GPT-2 generating a different number of
tokens on each rank (``tests/workers/divergent.py``): with ``synced_gpus`` left to Hugging Face or ``True``, the tokens
of ``"ddp"``; with ``synced_gpus=False``, and with a unit run on one rank only, an error on every rank, at once, that
names what each rank was doing; and a job whose rank fails after rank 0 finished does not exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, launch, without_rendezvous, write_payload
from tests.scenarios import Divergence

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # every test here launches processes

WORKER = "tests.workers.divergent"
PROMPT = 5  # tokens per prompt
NEW_TOKENS = (2, 7)  # per rank, as the worker generates them
SYNCED_RUNS = [
    (phase, strategy, synced)
    for phase in (Divergence.PREDICT, Divergence.VALIDATE, Divergence.FIT)
    for strategy, synced in (("ddp", None), ("zero3", None), ("zero3", True))
]


def generated(out: Path, phase: Divergence, strategy: str, synced: bool | None, rank: int) -> list[list[int]]:
    return json.loads((out / f"{phase.value}-{strategy}-{synced}.rank{rank}.json").read_text())


def test_synced_generation_gives_ddps_tokens(tmp_path: Path) -> None:
    """Rank 0 generates 2 tokens a prompt, rank 1 7; Hugging Face keeps the finished rank running forwards: every
    rank's tokens equal ``"ddp"``'s, in prediction, validation, and validation between two training epochs."""
    write_payload(tmp_path, runs=SYNCED_RUNS)
    launch(WORKER, [str(tmp_path)], 2, timeout=600)
    for phase, strategy, synced in SYNCED_RUNS:
        for rank in range(2):
            tokens = generated(tmp_path, phase, strategy, synced, rank)
            assert tokens and {len(t) for t in tokens} == {PROMPT + NEW_TOKENS[rank]}, (phase, strategy, rank)
            assert tokens == generated(tmp_path, phase, "ddp", None, rank), (phase, strategy, synced, rank)


STEP_ENDED = "the end of a forward of the whole module"
GATHERS_BLOCK = "the all-gather of unit `model.transformer.h.0` of Generating"
ONE_RANKS_UNIT = ["the all-gather of unit `blocks.1` of Branching", "the all-gather of unit `blocks.2` of Branching"]


DIVERGENT = {
    Divergence.PREDICT: [STEP_ENDED, GATHERS_BLOCK],
    Divergence.VALIDATE: [STEP_ENDED, GATHERS_BLOCK],
    Divergence.FIT: [STEP_ENDED, GATHERS_BLOCK],
    Divergence.BRANCH: ONE_RANKS_UNIT,
}


def test_divergent_ranks_fail_at_once_on_every_rank(tmp_path: Path) -> None:
    """``generate(synced_gpus=False)`` in prediction, validation and validation between two epochs: rank 0 finishes
    its step while rank 1 gathers the first block for its third token; a forward that runs ``blocks.1`` on rank 0
    only. One run after the other in one pair of processes (each run after a divergence on a process group of its own):
    every run fails on both ranks with the error naming what each was doing and the fix, within seconds (the group's
    timeout is 30 minutes)."""
    runs = [(phase, "zero3", False) for phase in DIVERGENT]
    write_payload(tmp_path, runs=runs, in_turn=True)
    launch(WORKER, [str(tmp_path)], 2, timeout=300)
    for phase, strategy, synced in runs:
        doing = DIVERGENT[phase]
        for rank in range(2):
            seen = json.loads((tmp_path / f"{phase.value}-{strategy}-{synced}.rank{rank}.json").read_text())
            assert seen["error"] is not None, (phase, rank)
            assert f"(seen on rank {rank}): rank 0: {doing[0]}" in seen["error"], seen["error"]
            assert f"rank 1: {doing[1]}" in seen["error"]
            assert "HINT: a Hugging Face `generate()` that stops earlier on some ranks needs `synced_gpus=True`" in (
                seen["error"]
            )
            assert seen["seconds"] < 30, (phase, seen["seconds"])  # the run itself: a divergence is caught at once


def test_a_rank_failing_after_rank_0_finished_fails_the_job(tmp_path: Path) -> None:
    """Lightning's own launcher (``Trainer(devices=2)`` in a plain ``python`` process): rank 1 raises after rank 0
    finished its work; rank 0, the job, waits for it and exits 1 with a line naming it."""
    write_payload(tmp_path, runs=[(Divergence.PREDICT, "zero3", None)], rank1_fails_last=True)
    job = subprocess.run(
        [sys.executable, "-m", WORKER, str(tmp_path)],
        cwd=REPO,
        env=without_rendezvous(WORLD_SIZE="2", PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 1, job.stderr[-3000:]
    assert "ValueError: rank 1 fails after its last run" in job.stderr
    assert "lightning_zero: rank 1 (exit code 1), started by this process (rank 0), failed" in job.stderr
