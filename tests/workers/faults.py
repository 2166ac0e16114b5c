"""Runs inside each of 2 processes (started by tests/test_faults.py): trains under one strategy after another while the
test injects faults from outside (stops or kills a rank), or the module raises the user's own error; records how each
run ended and leaves a marker file the test waits on.

``python -m tests.workers.faults OUT``, the payload in ``OUT`` holding ``timeout`` (the strategy's, in seconds),
``offload_dir`` (if not ``None``, train with ``offload_optimizer="disk"`` there) and ``runs``, a list of
:class:`~tests.scenarios.FaultyRun`: a strategy and the :class:`~tests.scenarios.Fault` that breaks it. Rank 1 stops
itself after writing ``OUT/rank1.stopped``: in the step, rank 0 then waits in the forward; between steps, first in
Lightning's broadcast at the start of the next.

Rank 1 runs out of memory by lowering its address-space limit (``RLIMIT_AS``) to what it has mapped, after writing
``OUT/rank1.limited``: in ``training_step`` or a hook of the backward it then allocates, which raises ``MemoryError``;
before a save (a checkpoint after every step, into ``OUT/checkpoints``) the save itself runs out; before a load (a
run of ``REACHED`` steps saves ``OUT/resume.ckpt``, the next resumes from it) the load does.

Each rank writes ``OUT/rank<r>.reached`` once its first run has finished step ``REACHED``, and after each run that
raised, ``OUT/rank<r>.json``: per run so far, the exception that left ``fit`` (type, message, the traceback Python
would print) and the wall-clock time Lightning caught the first exception (before its teardown). The last run's
exception is raised again, so the process ends as a user's script would.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.scenarios import Fault, FaultyRun, cpu_trainer, read_payload
from tests.workers.modules_zero3 import TiedLM

REACHED = 2
RAISE_AT = 3


class FailingLM(TiedLM):
    """The stage-3 test module (units, tied weights), raising the user's own error in ``fault`` at step ``RAISE_AT``."""

    def __init__(self, fault: Fault, out: Path) -> None:
        super().__init__()
        self.fault = fault
        self.out = out

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fault is Fault.TRAINING_STEP and self.global_step == RAISE_AT:
            raise ValueError(f"deliberate failure in training_step at step {RAISE_AT}")
        if self.fault is Fault.RANK1_STOPS_IN_STEP and self.global_step == RAISE_AT:
            self._stop_rank1()
        if self.fault is Fault.RANK1_OUT_OF_MEMORY_IN_STEP and self.global_step == RAISE_AT:
            self._rank1_allocates_past_its_limit()
        loss = super().training_step(batch, batch_idx)
        if self.fault is Fault.RANK1_OUT_OF_MEMORY_IN_BACKWARD and self.global_step == RAISE_AT:
            loss.register_hook(self._rank1_allocates_past_its_limit)
        return loss

    def on_fit_start(self) -> None:  # after the strategy's set-up, before a resume's load
        if self.fault is Fault.RANK1_OUT_OF_MEMORY_BEFORE_LOAD:
            self._limit_rank1()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.fault is Fault.RANK1_OUT_OF_MEMORY_BEFORE_SAVE and self.global_step == RAISE_AT:
            self._limit_rank1()

    def _rank1_allocates_past_its_limit(self, *_: Any) -> None:
        if self._limit_rank1():
            bytearray(2**30)

    def _limit_rank1(self) -> bool:
        """On rank 1: no memory beyond what it has mapped now (and the marker is written first)."""
        if self.global_rank != 1:
            return False
        (self.out / "rank1.limited").touch()
        mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped, resource.RLIM_INFINITY))
        return True

    def on_train_start(self) -> None:
        if self.fault is Fault.ON_TRAIN_START:  # before any forward, as a resume that fails to load raises
            raise ValueError("deliberate failure in on_train_start at step 0")

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        if self.fault is Fault.RANK1_STOPS_BETWEEN_STEPS and self.global_step == RAISE_AT:
            self._stop_rank1()

    def _stop_rank1(self) -> None:
        if self.global_rank == 1:
            (self.out / "rank1.stopped").touch()
            os.kill(os.getpid(), signal.SIGSTOP)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.fault is Fault.VALIDATION_STEP and self.global_step == RAISE_AT:
            raise ValueError(f"deliberate failure in validation_step at step {RAISE_AT}")
        super().validation_step(batch, batch_idx)


class Markers(pl.Callback):
    def __init__(self, out: Path, first: bool) -> None:
        self.out = out
        self.first = first
        self.caught_at: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.first and trainer.global_step == REACHED:
            (self.out / f"rank{trainer.global_rank}.reached").touch()

    def on_exception(self, *_: Any) -> None:
        self.caught_at = time.time()


def fit(run: FaultyRun, timeout: float, offload_dir: Path | None, markers: Markers) -> None:
    callbacks: list[pl.Callback] = [markers]
    if run.fault is Fault.RANK1_OUT_OF_MEMORY_BEFORE_SAVE:
        callbacks.append(ModelCheckpoint(markers.out / "checkpoints", every_n_train_steps=1, save_top_k=-1))
    resume = markers.out / "resume.ckpt" if run.fault is Fault.RANK1_OUT_OF_MEMORY_BEFORE_LOAD else None
    if resume is not None:
        pl.seed_everything(0)
        saving = cpu_trainer(strategy_of(run, timeout, offload_dir), REACHED)
        saving.fit(FailingLM(Fault.NONE, markers.out))
        saving.save_checkpoint(resume)
        torch.serialization.add_safe_globals([Fault, type(resume)])  # FailingLM's hyper-parameters
    pl.seed_everything(0)
    trainer = cpu_trainer(
        strategy_of(run, timeout, offload_dir),
        10**6,
        max_epochs=-1,
        val_check_interval=RAISE_AT,
        limit_val_batches=2 if run.fault is Fault.VALIDATION_STEP else 0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=len(callbacks) > 1,
    )
    trainer.fit(FailingLM(run.fault, markers.out), ckpt_path=resume)


def strategy_of(run: FaultyRun, timeout: float, offload_dir: Path | None) -> Any:
    limit = timedelta(seconds=timeout)
    if run.strategy == "ddp":
        return DDPStrategy(timeout=limit)
    offload = {"offload_optimizer": "disk", "offload_dir": offload_dir} if offload_dir is not None else {}
    return ZeroStrategy(stage=int(run.strategy.removeprefix("zero")), timeout=limit, **offload)


def start_together(out: Path) -> None:
    """Wait until every rank has imported everything: on a loaded machine one rank can start seconds after the other,
    more than the small timeouts of these runs allow the rendezvous."""
    (out / f"rank{os.environ['RANK']}.started").touch()
    while not all((out / f"rank{rank}.started").exists() for rank in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)


def main(out: Path) -> None:
    payload = read_payload(out)
    start_together(out)
    ended: list[dict[str, Any]] = []
    for index, run in enumerate(payload["runs"]):
        markers = Markers(out, first=index == 0)
        try:
            fit(run, payload["timeout"], payload["offload_dir"], markers)
        except BaseException as error:
            ended.append({
                "type": type(error).__name__,
                "message": str(error),
                "traceback": "".join(traceback.format_exception(error)),
                "caught_at": markers.caught_at,
            })
            limit = resource.getrlimit(resource.RLIMIT_AS)  # the record is this test's, not the run's: room for it
            resource.setrlimit(resource.RLIMIT_AS, (limit[1], limit[1]))
            (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(ended))
            resource.setrlimit(resource.RLIMIT_AS, limit)
            if index == len(payload["runs"]) - 1:
                raise


if __name__ == "__main__":
    main(Path(sys.argv[1]))
