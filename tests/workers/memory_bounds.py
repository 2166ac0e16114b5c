"""Runs inside each of 2 processes (tests/launch.py): trains under stage 1 and 2 with small buckets and records, at
the end of every step, the bytes the engine's communication pool retains and the size of its largest bucket."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_zero import ZeroStrategy
from lightning_zero.memory import engine_of
from tests.scenarios import cpu_trainer
from tests.workers.modules import Classifier


class PoolProbe(pl.Callback):
    def __init__(self) -> None:
        self.retained: list[int] = []
        self.largest_bucket = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        engine = engine_of(trainer.strategy)
        self.retained.append(engine.pool.nbytes())
        sizes = [b.layout.numel * b.dtype.itemsize for b in engine.reducer.buckets]
        self.largest_bucket = max(sizes)


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for stage in (1, 2):
        pl.seed_everything(0)
        probe = PoolProbe()
        trainer = cpu_trainer(ZeroStrategy(stage=stage, bucket_cap_mb=0.001), 4, callbacks=[probe])
        trainer.fit(Classifier(hidden=64))
        buckets = len(engine_of(trainer.strategy).reducer.buckets)
        results[stage] = {"retained": probe.retained, "largest_bucket": probe.largest_bucket, "buckets": buckets}
    if trainer.global_rank == 0:
        (out / "pool.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
