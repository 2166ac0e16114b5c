"""Runs inside each of 2 processes: trains Lightning's demo Transformer and a residual MLP, each at two depths, under
``Zero3Strategy.from_deepspeed_config`` with parameters and optimizer on ``"nvme"``, and records each run's
anonymous memory at its peak over that as it began (:class:`tests.memory_group.AnonymousPeak`, sampled) and its
resident memory likewise (``VmHWM``, exact), parameter count, largest unit,
losses and seconds, for
tests/test_infinity_memory.py. Arguments: the output directory, the offload directory, then ``model:width:layers``
runs."""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.transformer import Transformer
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import Zero3Strategy
from tests.memory_group import AnonymousPeak, reset_resident_peak, resident_peak
from tests.scenarios import QUIET, save_results

STEPS = 2
VOCAB = 256


class Trained(pl.LightningModule):
    """One of the two shapes, built in ``configure_model``; records its losses."""

    def __init__(self, model: str, width: int, layers: int) -> None:
        super().__init__()
        self.shape, self.width, self.layers = model, width, layers
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        if self.shape == "transformer":  # 16 heads, feed-forward 4x, as the benchmark's
            self.net = Transformer(VOCAB, ninp=self.width, nhead=16, nhid=4 * self.width, nlayers=self.layers)
        else:
            self.net = nn.Sequential(*(nn.Linear(self.width, self.width) for _ in range(self.layers)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if self.shape == "transformer":
            loss = nn.functional.nll_loss(self.net(x[:, :-1], x[:, 1:]), x[:, 1:].reshape(-1))
        else:
            loss = self.net(x.float()).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        if self.shape == "transformer":  # one row of 4 tokens: activations negligible beside the parameters
            data = torch.randint(0, VOCAB, (STEPS * 2, 5), generator=generator)
        else:
            data = torch.randn(STEPS * 2, self.width, generator=generator)
        return DataLoader(TensorDataset(data), batch_size=1)


def largest_unit(module: nn.Module) -> int:
    """Parameters of the largest stage-3 unit of ``module``: those it gathers itself, not those of units inside it."""
    sizes = []
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            units = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
            inner = {id(p) for m in units for p in m.parameters()}
            sizes.append(sum(p.numel() for p in unit.parameters() if id(p) not in inner))
    return max(sizes)


def left_ring_bytes() -> int:
    """Resident bytes of the stage-3 gather ring an earlier run left mapped (``/dev/shm/...ring``, unlinked): the
    shared-memory channel outlives a run and keeps it until the next run opens its own, so it is in the resident
    memory as a run starts and gone by its peak, sized by the earlier run's largest unit."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = any(field.endswith(".ring") for field in fields[5:])
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def main() -> None:
    out_dir, offload_dir, *runs = sys.argv[1:]
    nvme = {"device": "nvme", "nvme_path": offload_dir}
    config = {"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}
    results = []
    for run in runs:
        shape, width, layers = run.split(":")
        module = Trained(shape, int(width), int(layers))
        pl.seed_everything(0, verbose=False)
        reset_resident_peak()
        resident = resident_peak() - left_ring_bytes()  # the earlier run's ring goes as this run's opens
        peak, started = AnonymousPeak(), time.perf_counter()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=Zero3Strategy.from_deepspeed_config(config), max_steps=STEPS,
            **QUIET,
        )  # fmt: skip
        trainer.fit(module)
        params = sum(p.numel() for p in module.parameters())
        results.append({"run": run, "params": params, "grew": peak.stop() - peak.start, "losses": module.losses,
                        "largest_unit": largest_unit(module),
                        "resident_grew": resident_peak() - resident,
                        "seconds": time.perf_counter() - started})  # fmt: skip
        del trainer, module
        gc.collect()  # the next run's peak starts from what this one left
    save_results(Path(out_dir), int(os.environ["RANK"]), results)


if __name__ == "__main__":
    main()
