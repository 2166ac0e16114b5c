"""Runs inside each of 2 processes (tests/test_auto_parity.py): the classifier trained under ``zero_auto`` and under
the strategy it chose, named by hand, for two budgets (the measured one, and ``memory_per_rank`` with room for stage
2 and not stage 1), for a module built under ``trainer.init_module()``, and in a Fabric loop; writes what each run
ends with, and what zero_auto chose."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

import lightning_zero  # noqa: F401 (registers the strategy names)
from lightning_zero import ZeroAutoStrategy
from tests.oracle import full_snapshot
from tests.scenarios import QUIET
from tests.workers.modules import Classifier

WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read now: Lightning's teardown removes it from the environment
# the classifier's 3,483 fp32 parameters with Adam on 2 CPU ranks, its model state and working buffers per rank:
# zero2_offload 48,762 bytes (the host step is fused: no temporaries), zero2 55,730, zero1 62,696 (zero3 as zero1: all
# of it is the root; and 64 KiB beside each of its 10 parameter tensors); without offload, room for stage 2 and not
# stage 1
ROOM_FOR_STAGE_2 = 60_000
STEPS = 6


def fit(strategy: Any, under_init_module: bool = False) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=STEPS, **QUIET)
    if under_init_module:
        with trainer.init_module():
            module = Classifier()
    else:
        module = Classifier()
    trainer.fit(module)
    return trainer


def fabric_loop(strategy: Any) -> tuple[Fabric, dict[str, Any]]:
    """The classifier's optimizer and batches in a Fabric loop: its losses, parameters and optimizer state."""
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    module = Classifier()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    data = torch.Generator().manual_seed(fabric.global_rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 12, generator=data), torch.randint(0, 4, (8,), generator=data)
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    state = tree_map_only(DTensor, lambda t: t.to_local().clone(), fabric.strategy.get_optimizer_state(optimizer))
    params = [p.detach().clone() for p in module.parameters()]
    return fabric, {"losses": losses, "params": params, "optimizer": state, "ran": ran(fabric.strategy)}


def ran(strategy: Any) -> tuple[str, int, bool]:
    """How the run trained: its mode's class, its stage and whether it offloaded (equal results alone would not tell
    the stages apart: they train alike)."""
    return type(strategy.mode).__name__, int(strategy.stage), strategy.placement.offloads


def compared(chosen: str, auto: pl.Trainer, by_hand: pl.Trainer) -> dict[str, Any]:
    return {"chosen": chosen, **{name: {**full_snapshot(t), "ran": ran(t.strategy)} for name, t in (("auto", auto),
            ("by_hand", by_hand))}}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {}
    for case, strategy in (
        ("measured", "zero_auto"),
        ("room_for_stage_2", ZeroAutoStrategy(memory_per_rank=ROOM_FOR_STAGE_2, activation_reserve=0, offload=False)),
    ):
        auto = fit(strategy)
        chosen = auto.strategy.auto_choice.name
        by_hand = fit(chosen)
        results[case] = compared(chosen, auto, by_hand)
    auto = fit("zero_auto", under_init_module=True)  # built eagerly before the choice, as "ddp" builds
    chosen = auto.strategy.auto_choice.name
    results["init_module"] = compared(chosen, auto, fit(chosen, under_init_module=True))
    fabric, auto_loop = fabric_loop("zero_auto")
    chosen = fabric.strategy.auto_choice.name
    results["fabric"] = {"chosen": chosen, "auto": auto_loop, "by_hand": fabric_loop(chosen)[1]}
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
