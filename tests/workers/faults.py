"""Runs inside each of 2 processes (started by tests/test_faults.py): trains under one strategy after another while the
test injects faults from outside (stops or kills a rank), or the module raises the user's own error; records how each
run ended and leaves a marker file the test waits on.

``python -m tests.workers.faults SPEC OUT``, SPEC a JSON file with ``timeout`` (the strategy's, in seconds), optional
``offload_dir`` (train with ``offload_optimizer="disk"`` there) and ``runs``, a list of ``{"strategy", "fault"}``:

- ``strategy``: ``"zero1"``, ``"zero2"`` or ``"zero3"``;
- ``fault``: ``"none"`` (train until the test stops or kills a rank; no validation, so that every collective of a step
  is this package's), ``"training_step"`` or ``"validation_step"`` (every rank raises ``ValueError`` there at global
  step ``RAISE_AT``), ``"on_train_start"`` (every rank raises ``ValueError`` there, before any forward),
  ``"rank1_stops_in_step"`` (rank 1 stops itself with SIGSTOP at the start of ``training_step`` at step ``RAISE_AT``,
  after writing ``OUT/rank1.stopped``: rank 0 then waits in the forward) or
  ``"rank1_stops_between_steps"`` (the same once step ``RAISE_AT`` has ended: rank 0 then waits first in Lightning's
  broadcast at the start of the next step).

Each rank writes ``OUT/rank<r>.reached`` once its first run has finished step ``REACHED``, and after each run that
raised, ``OUT/rank<r>.json``: per run so far, the exception that left ``fit`` (type, message, the traceback Python
would print) and the wall-clock time Lightning caught the first exception (before its teardown). The last run's
exception is raised again, so the process ends as a user's script would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_zero import ZeroStrategy
from tests.scenarios import QUIET
from tests.workers.modules_zero3 import TiedLM

REACHED = 2
RAISE_AT = 3


class FailingLM(TiedLM):
    """The stage-3 test module (units, tied weights), raising the user's own error in ``fault`` at step ``RAISE_AT``."""

    def __init__(self, fault: str, out: Path) -> None:
        super().__init__()
        self.fault = fault
        self.out = out

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fault == "training_step" and self.global_step == RAISE_AT:
            raise ValueError(f"deliberate failure in training_step at step {RAISE_AT}")
        if self.fault == "rank1_stops_in_step" and self.global_step == RAISE_AT:
            self._stop_rank1()
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        if self.fault == "on_train_start":  # before any forward, as a resume that fails to load raises
            raise ValueError("deliberate failure in on_train_start at step 0")

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        if self.fault == "rank1_stops_between_steps" and self.global_step == RAISE_AT:
            self._stop_rank1()

    def _stop_rank1(self) -> None:
        if self.global_rank == 1:
            (self.out / "rank1.stopped").touch()
            os.kill(os.getpid(), signal.SIGSTOP)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.fault == "validation_step" and self.global_step == RAISE_AT:
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


def fit(run: dict[str, Any], spec: dict[str, Any], markers: Markers) -> None:
    offload = {"offload_optimizer": "disk", "offload_dir": spec["offload_dir"]} if "offload_dir" in spec else {}
    strategy = ZeroStrategy(
        stage=int(run["strategy"].removeprefix("zero")), timeout=timedelta(seconds=spec["timeout"]), **offload
    )
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=10**6,
        max_epochs=-1,
        val_check_interval=RAISE_AT,
        limit_val_batches=2 if run["fault"] == "validation_step" else 0,
        num_sanity_val_steps=0,
        callbacks=[markers],
        **QUIET,
    )
    trainer.fit(FailingLM(run["fault"], markers.out))


def start_together(out: Path) -> None:
    """Wait until every rank has imported everything: on a loaded machine one rank can start seconds after the other,
    more than the small timeouts of these runs allow the rendezvous."""
    (out / f"rank{os.environ['RANK']}.started").touch()
    while not all((out / f"rank{rank}.started").exists() for rank in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)


def main(spec: dict[str, Any], out: Path) -> None:
    start_together(out)
    ended: list[dict[str, Any]] = []
    for index, run in enumerate(spec["runs"]):
        markers = Markers(out, first=index == 0)
        try:
            fit(run, spec, markers)
        except BaseException as error:
            ended.append({
                "type": type(error).__name__,
                "message": str(error),
                "traceback": "".join(traceback.format_exception(error)),
                "caught_at": markers.caught_at,
            })
            (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(ended))
            if index == len(spec["runs"]) - 1:
                raise


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
