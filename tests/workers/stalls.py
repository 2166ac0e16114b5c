"""Runs inside each of 2 processes (started by tests/test_stalls.py): a stall under the ZeRO strategies, which the
stall watchdog must end on every rank within the strategy's ``stall_after``.

``python -m tests.workers.stalls OUT``, the payload in ``OUT`` holding ``case`` and ``stall_after``:

- ``"fabric_branch"``: a Fabric loop under stage 3 whose forward runs one unit on rank 0 only;
- ``"rank1_stops"``: a Trainer under stage 2 whose rank 1 stops itself (SIGSTOP) at its third step;
- ``"nccl_rank1_stops"``: the same under stage 3 on 2 GPUs (NCCL), rank 0 meeting the others in a barrier after each
  step (NCCL's collectives do not block the host; its barrier does).

Started without a rank in its environment, it is the job Lightning's launcher makes of ``devices=2``: rank 0 starts
rank 1.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.launch import read_payload
from tests.scenarios import cpu_trainer

STOPS_AT = 2  # the step at which rank 1 stops itself


class Branching(nn.Module):
    """Three blocks, each a unit under stage 3; the middle one runs on rank 0 only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index != 1 or self.rank == 0:
                x = torch.tanh(block(x))
        return x


def fabric_branch(stall_after: float) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricZeroStrategy(stage=3, stall_after=stall_after))
    fabric.launch()
    torch.manual_seed(0)
    module = Branching(fabric.global_rank)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for _ in range(2):
        loss = model(torch.randn(2, 8)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


class Stopping(LightningModule):
    """A small regression whose rank 1 stops itself (SIGSTOP) at step :data:`STOPS_AT`."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step == STOPS_AT:
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StoppingOnGPU(Stopping):
    def on_train_batch_end(self, *args: Any) -> None:
        self.trainer.strategy.barrier()


def rank1_stops(stall_after: float) -> None:
    strategy = ZeroStrategy(stage=2, stall_after=stall_after, timeout=timedelta(seconds=20))
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=2)
    cpu_trainer(strategy, max_steps=6).fit(Stopping(), data)


def nccl_rank1_stops(stall_after: float) -> None:
    strategy = ZeroStrategy(stage=3, stall_after=stall_after, timeout=timedelta(seconds=120))
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=2)
    trainer = Trainer(accelerator="gpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(StoppingOnGPU(), data)


def main(out: Path) -> None:
    payload = read_payload(out)
    cases = {"fabric_branch": fabric_branch, "rank1_stops": rank1_stops, "nccl_rank1_stops": nccl_rank1_stops}
    cases[payload["case"]](payload["stall_after"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
