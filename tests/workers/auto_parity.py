"""Runs inside each of 2 processes (tests/test_auto_parity.py): the classifier trained under ``zero_auto`` and under
the strategy it chose, named by hand, for two budgets: the measured one, and ``memory_per_rank`` with room for stage
2 and not stage 1; writes what each run ends with, and what zero_auto chose."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_zero  # noqa: F401 (registers the strategy names)
from lightning_zero import ZeroAutoStrategy
from tests.oracle import full_snapshot
from tests.scenarios import QUIET
from tests.workers.modules import Classifier

WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read now: Lightning's teardown removes it from the environment
# the classifier's 3,483 fp32 parameters with Adam on 2 ranks, its model state and working buffers per rank: stage 1
# 62,696 bytes, stage 2 55,730 (stage 3 more: all of it is the root, gathered whole through the step)
ROOM_FOR_STAGE_2 = 60_000


def fit(strategy: Any) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=6, **QUIET)
    trainer.fit(Classifier())
    return trainer


def ran(trainer: pl.Trainer) -> tuple[str, int, bool]:
    """How the run trained: its mode's class, its stage and whether it offloaded (equal results alone would not tell
    the stages apart: they train alike)."""
    strategy = trainer.strategy
    return type(strategy.mode).__name__, int(strategy.stage), strategy.placement.offloads


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {}
    for case, strategy in (
        ("measured", "zero_auto"),
        ("room_for_stage_2", ZeroAutoStrategy(memory_per_rank=ROOM_FOR_STAGE_2, activation_reserve=0)),
    ):
        auto = fit(strategy)
        chosen = auto.strategy.auto_choice.name
        by_hand = fit(chosen)
        results[case] = {"chosen": chosen, **{name: {**full_snapshot(t), "ran": ran(t)} for name, t in (("auto", auto),
                         ("by_hand", by_hand))}}  # fmt: skip
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
