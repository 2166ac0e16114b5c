"""Runs inside each of 4 processes simulating 2 nodes of 2 (tests/launch.py with ``nodes=2``), or 2 processes for the
resume: ``argv`` the directory, whose payload names the :class:`~tests.scenarios.HybridPhase` to run. Trains under
"ddp" and every stage with hybrid sharding, saves hybrid checkpoints, trains stage 3 with ZeRO++'s parts, and writes
what rank 0 ends with for tests/test_hybrid.py and tests/test_zero_plus_plus.py."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from lightning_zero._transport.peers import group_timeout
from lightning_zero._transport.traffic import TRAFFIC
from lightning_zero.memory import engine_of, measure
from tests.oracle import full_snapshot
from tests.scenarios import QUIET, HybridPhase, read_payload
from tests.workers.modules import Classifier

WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read now: Lightning's teardown removes it from the environment
# ZeRO++ on the same 2 nodes: its parts alone and together, fully sharded and hybrid; stage 3's units (one per
# Linear) gathered again for backward (none kept whole), so that the secondary copy's gathers show
_UNITS = {"stage": 3, "auto_wrap_policy": {torch.nn.Linear}, "keep_for_backward_mb": 0}
ZERO_PLUS_PLUS: dict[str, dict[str, Any]] = {
    "full": _UNITS,
    "hybrid": {**_UNITS, "shard_group_size": "node"},
    "secondary": {**_UNITS, "secondary_group_size": "node"},
    "quantized_weights": {**_UNITS, "quantize_weights": True},
    "quantized_gradients": {**_UNITS, "quantize_gradients": True},
    "zero++": {**_UNITS, "quantize_weights": True, "quantize_gradients": True, "secondary_group_size": "node"},
    "hybrid_quantized": {**_UNITS, "shard_group_size": "node", "quantize_gradients": True},
    # on `fully_shard` (the optimizer offloaded): its own collectives replaced, the secondary copy through torch's
    "full_offload": {**_UNITS, "offload_optimizer": True},
    "secondary_offload": {**_UNITS, "offload_optimizer": True, "secondary_group_size": "node"},
    "zero++_offload": {
        **_UNITS, "offload_optimizer": True, "quantize_weights": True, "quantize_gradients": True,
        "secondary_group_size": "node",
    },
    # stage 2 in buckets of about a parameter each: the one holding the 0-dim temperature reduces exactly
    "full2": {"stage": 2, "bucket_cap_mb": 0.001},
    "hybrid2": {"stage": 2, "bucket_cap_mb": 0.001, "shard_group_size": "node"},
    "quantized_gradients2": {"stage": 2, "bucket_cap_mb": 0.001, "quantize_gradients": True},
    "hybrid_quantized2": {"stage": 2, "bucket_cap_mb": 0.001, "shard_group_size": "node", "quantize_gradients": True},
    # DeepSpeed's ZeRO++ keys as its tutorial sets them (the secondary partition: the ranks of a node)
    "deepspeed_zero++": {
        "auto_wrap_policy": {torch.nn.Linear}, "keep_for_backward_mb": 0,
        "deepspeed_config": {"zero_optimization": {
            "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2,
        }},
    },
    # the same run again, with buffers from the pool the first one used
    "quantized_gradients2_again": {"stage": 2, "bucket_cap_mb": 0.001, "quantize_gradients": True},
}


class Held(pl.Callback):
    """Model state right before an optimizer step, when gradients exist under every stage."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        self.held = measure(module, trainer.optimizers, engine_of(trainer.strategy))


def fit(strategy: Any, max_steps: int, nodes: int, ckpt_path: Path | None = None) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD_SIZE // nodes, num_nodes=nodes, strategy=strategy, max_steps=max_steps,
        callbacks=[Held()], **QUIET,
    )  # fmt: skip
    trainer.fit(Classifier(batch_norm=True), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    out = Path(sys.argv[1])
    phase = read_payload(out)["phase"]
    results: dict[str, Any] = {}
    if phase is HybridPhase.TRAIN:
        # the first run creates the process group, with its strategy's timeout, which the shard groups must keep
        results["ddp"] = full_snapshot(fit(DDPStrategy(timeout=timedelta(seconds=123)), 6, nodes=2))
        for stage in (1, 2, 3):
            TRAFFIC.reset()
            trainer = fit(ZeroStrategy(stage=stage, shard_group_size="node"), 6, nodes=2)
            mesh = trainer.strategy.mode._mesh()
            waits = [group_timeout(g).total_seconds() for g in (mesh.shard_group, mesh.replicate, mesh.world)]
            held = next(c for c in trainer.callbacks if isinstance(c, Held)).held
            results[f"zero{stage}"] = {
                **full_snapshot(trainer), "across_nodes": dict(TRAFFIC.across_nodes), "model_state": held,
                "timeouts": waits,
            }
            trainer.save_checkpoint(out / f"hybrid-zero{stage}")
        for name, options in ZERO_PLUS_PLUS.items():
            TRAFFIC.reset()
            trainer = fit(ZeroStrategy(**options), 6, nodes=2)
            results[name] = {**full_snapshot(trainer), "across_nodes": dict(TRAFFIC.across_nodes)}
    elif phase is HybridPhase.RESUME:
        for stage in (1, 2, 3):
            other = 3 if stage < 3 else 2
            restored = fit(ZeroStrategy(stage=other), 6, nodes=1, ckpt_path=out / f"hybrid-zero{stage}")
            results[f"restored-zero{stage}"] = full_snapshot(restored)  # max_steps reached: restored, not trained
        continued = fit(ZeroStrategy(stage=3), 8, nodes=1, ckpt_path=out / "hybrid-zero2")
        results["continued"] = full_snapshot(continued)
    torch.save(results, out / f"{phase.value}-rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
