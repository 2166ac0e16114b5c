"""Runs inside each of N processes (started by tests/launch.py): trains every scenario under every strategy and
saves what rank 0 ends with, and what every rank measured, for the test to compare."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_zero._transport import shared_memory
from lightning_zero.memory import engine_of, measure, storage_bytes
from tests.oracle import full, full_optimizer_state
from tests.scenarios import QUIET, Scenario, StrategySpec, read_payload, save_results
from tests.workers.modules import MODULES

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read now: Lightning's teardown removes it from the environment


class LogRecorder(logging.Handler):
    """Keeps the messages Lightning's loggers emit during a run (the strategy's memory report among them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class MemoryProbe(pl.Callback):
    """Bytes per rank, by walking tensors (deduplicated by storage): gradients right before the first step."""

    def __init__(self) -> None:
        self.grad_bytes: int | None = None
        self.full_grads: int | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if self.grad_bytes is not None:
            return
        engine = engine_of(trainer.strategy)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.full_grads = len(grads)
        if engine is not None:
            grads += [b.buffer for b in engine.reducer.buckets if b.buffer is not None and b.shard_grads is None]
            grads += [b.shard_grads for b in engine.reducer.buckets if b.shard_grads is not None]
        self.grad_bytes = storage_bytes(grads)


def optimizer_state_bytes(optimizer: Any) -> int:
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors)


def run(scenario: Scenario, strategy: StrategySpec, out_dir: Path) -> dict[str, Any]:
    ckpt_path = None
    if scenario.resume_at is not None:  # train part of the way, save, and resume in a fresh Trainer and module
        first, _ = fit(scenario, scenario.save_with or strategy, max_steps=scenario.resume_at)
        ckpt_path = out_dir / f"{scenario.name}-{strategy.file_name}.ckpt"
        first.save_checkpoint(ckpt_path)
    recorder = LogRecorder()
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(recorder)
    handed_out = shared_memory.ring_handouts()
    try:
        trainer, probe = fit(scenario, strategy, ckpt_path=ckpt_path)
    finally:
        lightning_logger.removeHandler(recorder)
    module = trainer.lightning_module
    result: dict[str, Any] = {
        "losses": list(module.losses),
        "state_dict": {k: full(v).detach().clone() for k, v in module.state_dict().items()},
        # stage 3: whether each DTensor is split by rows, and this rank's part of it
        "shards": {
            k: (v.placements == (Shard(0),), v.to_local().detach().clone())
            for k, v in module.state_dict().items()
            if isinstance(v, DTensor)
        },
        "optimizers": [full_optimizer_state(opt) for opt in trainer.optimizers],
        "lrs": [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers],
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "grad_bytes": probe.grad_bytes,
        "full_grads": probe.full_grads,
        "state_bytes": [optimizer_state_bytes(opt) for opt in trainer.optimizers],
        "model_state": measure(module, trainer.optimizers, engine_of(trainer.strategy)),
        "memory_reports": [m for m in recorder.messages if m.startswith("Model state per rank")],
        "ring_handouts": shared_memory.ring_handouts() - handed_out,  # units gathered in the shared gather ring
    }
    engine = engine_of(trainer.strategy)
    if engine is not None and any(s.has_master for s in engine.sharded):
        result["masters"] = [s.shard.detach().full_tensor() for s in engine.sharded]
    if hasattr(module, "report"):
        result.update(module.report())
    for fn in scenario.after_fit:
        if fn == "predict":
            preds = trainer.predict(module)
            result["predict"] = torch.cat(preds) if preds else None
        else:
            result[fn] = getattr(trainer, fn)(module, verbose=False)
    return result


def fit(
    scenario: Scenario, strategy: StrategySpec, max_steps: int | None = None, ckpt_path: Path | None = None
) -> tuple[pl.Trainer, MemoryProbe]:
    pl.seed_everything(scenario.seed, workers=True)
    module = MODULES[scenario.module](**scenario.module_kwargs)
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy.for_trainer(),
        max_steps=max_steps or scenario.max_steps,
        num_sanity_val_steps=0,
        **QUIET,
        limit_val_batches=scenario.limit_val_batches,
    )
    trainer_kwargs.update(scenario.trainer_kwargs)
    probe = MemoryProbe()
    trainer = pl.Trainer(callbacks=[probe], **trainer_kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, probe


def main() -> None:
    out_dir = Path(sys.argv[1])
    results = {}
    for scenario in read_payload(out_dir)["scenarios"]:
        for strategy in scenario.strategies:
            results[(scenario.name, strategy.label)] = run(scenario, strategy, out_dir)
    save_results(out_dir, torch.distributed.get_rank(), results)


if __name__ == "__main__":
    main()
