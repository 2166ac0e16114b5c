"""Runs inside each of N processes (started by tests/launch.py): trains a module under ``zero3`` in one Trainer after
another and records whether each finished module is freed once the user drops it.

``python -m tests.workers.lifetime OUT``
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

import lightning_zero  # noqa: F401  (registers "zero3")
from tests.workers.modules_zero3 import TiedLM


def train_once(world_size: int) -> weakref.ref[TiedLM]:
    module = TiedLM()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy="zero3", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    return weakref.ref(module)


def main(out: Path) -> None:
    world_size = int(os.environ["WORLD_SIZE"])
    finished = [train_once(world_size) for _ in range(3)]
    gc.collect()
    alive = [ref() is not None for ref in finished]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(alive))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
