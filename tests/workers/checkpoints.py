"""Runs inside each of N processes (started by tests/launch.py) for the checkpoint tests; ``argv``: the directory, whose
payload names the :class:`~tests.scenarios.CheckpointPhase` to run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

import lightning_zero  # noqa: F401
from tests.oracle import full_snapshot, snapshot
from tests.scenarios import MODULE_KWARGS, CheckpointPhase, cpu_trainer, read_payload
from tests.workers.modules import Classifier

EXACT_STAGES = ("zero1", "zero2", "zero3")
EPOCH_STEPS = 6  # 96 samples, batches of 8, on 2 ranks
EXACT_STEPS = 10


def resume_exactly(out: Path) -> None:
    """Per stage: an uninterrupted run, a run stopped at an epoch end and saved, and its resume in a fresh Trainer and
    module; once for the checkpoint ``ModelCheckpoint(every_n_train_steps=...)`` writes on the step that closes the
    epoch (training bounded by ``max_steps``), once for ``every_n_epochs`` (bounded by ``max_epochs``)."""
    for strategy in EXACT_STAGES:
        results = {}
        for bound, every, stop, end in (
            ("max_steps", {"every_n_train_steps": EPOCH_STEPS}, EPOCH_STEPS, EXACT_STEPS),
            ("max_epochs", {"every_n_epochs": 1}, 1, 2),
        ):
            results[bound, "truth"] = full_snapshot(fit(strategy, **{bound: end}))
            saving = ModelCheckpoint(dirpath=out / f"exact-{strategy}-{bound}", **every)
            fit(strategy, **{bound: stop}, callbacks=[saving], enable_checkpointing=True)
            path = Path(saving.best_model_path)
            resumed = fit(strategy, **{bound: end}, ckpt_path=path)
            results[bound, "resumed"] = {**full_snapshot(resumed), "checkpoint": path.name}
        torch.save(results, out / f"exact-{strategy}-rank{resumed.global_rank}.pt")


def fit(strategy: str, max_steps: int = -1, ckpt_path: Path | None = None, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    t = cpu_trainer(strategy, max_steps, **kwargs)
    t.fit(Classifier(**MODULE_KWARGS), ckpt_path=ckpt_path)
    return t


def save_rank0(obj: Any, path: Path) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(obj, path)


def main() -> None:
    out = Path(sys.argv[1])
    phase = read_payload(out)["phase"]
    if phase is CheckpointPhase.TRAIN:
        t = fit("zero2", 12)
        save_rank0(snapshot(t), out / "truth.pt")
        t.save_checkpoint(out / "zero2-2ranks")
        save_rank0(snapshot(fit("ddp", 12)), out / "ddp.pt")
        rotating = ModelCheckpoint(dirpath=out / "rotating", every_n_train_steps=2, save_top_k=2, monitor="step",
                                   mode="max")
        fit("zero1", 8, callbacks=[rotating], enable_checkpointing=True)
        # an epoch is 6 steps on 2 ranks: keep every epoch's checkpoint, resume from the second to the end
        for strategy in ("zero2", "ddp"):
            every_epoch = ModelCheckpoint(dirpath=out / strategy, every_n_epochs=1, save_top_k=-1)
            fit(strategy, 18, callbacks=[every_epoch], enable_checkpointing=True)
            resumed = fit(strategy, 18, ckpt_path=out / strategy / "epoch=1-step=12.ckpt")
            save_rank0(snapshot(resumed), out / f"{strategy}-resumed.pt")
    elif phase is CheckpointPhase.RESUME_EXACTLY:
        resume_exactly(out)
    elif phase is CheckpointPhase.RESUME_3RANKS_ZERO1:
        t = fit("zero1", 12, ckpt_path=out / "zero2-2ranks")
        save_rank0(snapshot(t), out / "restored-3ranks.pt")
        t.save_checkpoint(out / "zero1-3ranks")
    elif phase is CheckpointPhase.RESUME_1RANK_ZERO2:
        t = fit("zero2", 12, ckpt_path=out / "zero1-3ranks")
        save_rank0(snapshot(t), out / "restored-1rank.pt")
        t.save_checkpoint(out / "zero2-1rank")
        t = fit("zero1", 14, ckpt_path=out / "zero2-1rank")  # and training goes on from there
        save_rank0(snapshot(t), out / "continued-1rank.pt")
    elif phase is CheckpointPhase.CRASH_DURING_SAVE:
        t = fit("zero2", 4)
        t.save_checkpoint(out / "good")
        original = FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            original(self, plan, planner)
            os._exit(17)

        FileSystemWriter.write_data = write_then_die
        t.save_checkpoint(out / "interrupted")
    elif phase is CheckpointPhase.RESUME_AFTER_CRASH:
        t = fit("zero2", 6, ckpt_path=out / "good")
        save_rank0(snapshot(t), out / "after-crash.pt")
        t.save_checkpoint(out / "interrupted")  # the same name now saves cleanly over the leftovers
    else:
        raise ValueError(phase)


if __name__ == "__main__":
    main()
