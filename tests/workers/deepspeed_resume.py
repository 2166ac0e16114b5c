"""Runs inside each of 2 processes (started by tests/launch.py): resume DeepSpeed fixtures under the ZeRO strategies
and their consolidated files under ``"ddp"``, 3 steps each; ``argv``: the output directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_zero  # noqa: F401
from lightning_zero._checkpoint.keys import module_names
from tests.fixtures.deepspeed.make_fixtures import CASES, checkpoint_path
from tests.fixtures.deepspeed.model import FixtureModel
from tests.oracle import full, full_optimizer_state
from tests.scenarios import cpu_trainer

MORE_STEPS = 3
# (label, strategy, fixture): each fixture saved at 3 ranks, resumed at 2 under another stage (or the same, for
# Lightning's directory with its loop and scheduler state)
RESUMES = [
    ("zero1-from-stage3", "zero1", "stage3_w3"),
    ("zero2-from-groups-stage2", "zero2", "groups_stage2_w3"),
    ("zero3-from-frozen-stage3", "zero3", "frozen_stage3_w3"),
    ("zero3-from-lightning-stage3", "zero3", "lightning_stage3_w3"),
]
VALIDATED = "bf16_stage2_w3"  # loaded by `validate` under zero3: weights only, the bf16 run's fp32 masters


def named_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Every parameter whole and its optimizer state by name, the global step and the learning rates."""
    module = trainer.lightning_module
    optimizer = trainer.optimizers[0]
    names = module_names(module)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = full_optimizer_state(optimizer)["state"]
    snapshot: dict[str, Any] = {"params": {n: full(p).detach().clone() for n, p in module.named_parameters()}}
    for key in ("exp_avg", "exp_avg_sq", "step"):
        snapshot[key] = {order[i]: entries[key].clone() for i, entries in state.items()}
    snapshot["global_step"] = trainer.global_step
    snapshot["lr"] = [group["lr"] for group in optimizer.param_groups]
    return snapshot


class RecordRestored(pl.Callback):
    def __init__(self, file: Path) -> None:
        self.file = file

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        save_rank0(named_state(trainer), self.file)


def save_rank0(obj: Any, path: Path) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(obj, path)


def fit(strategy: str, case: str, ckpt_path: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    pl.seed_everything(0)
    steps = MORE_STEPS + (3 if CASES[case].lightning else 0)  # a Lightning checkpoint resumes its global step
    trainer = cpu_trainer(strategy, steps, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(FixtureModel(**CASES[case].model), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    out = Path(sys.argv[1])
    for label, strategy, case in RESUMES:
        trainer = fit(strategy, case, checkpoint_path(case), [RecordRestored(out / f"{label}-restored.pt")])
        save_rank0(named_state(trainer), out / f"{label}-final.pt")
        trainer = fit("ddp", case, out / f"{case}.ckpt", [])
        save_rank0(named_state(trainer), out / f"ddp-{label}-final.pt")
    validator = cpu_trainer("zero3", limit_val_batches=1)
    model = FixtureModel(**CASES[VALIDATED].model)
    validator.validate(model, ckpt_path=checkpoint_path(VALIDATED))
    save_rank0({n: full(p).detach().clone() for n, p in model.named_parameters()}, out / "validated.pt")


if __name__ == "__main__":
    main()
