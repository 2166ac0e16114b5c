"""Runs inside each of N processes: trains a wide classifier under one strategy and records, after training, this
process's resident memory and the bytes of optimizer state it keeps, for tests/test_offload.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_zero.memory import storage_bytes
from tests.oracle import full
from tests.scenarios import QUIET, read_payload, save_results
from tests.workers.modules import Classifier


def resident_bytes() -> int:
    """This process's resident set (VmRSS), anonymous and file-backed pages alike."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def resident_file_bytes(directory: str) -> int:
    """Resident bytes of the mappings of files under ``directory`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: address range, perms, ..., path
            inside = len(fields) >= 6 and fields[5].startswith(directory)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


class Record(pl.Callback):
    def __init__(self, offload_dir: str) -> None:
        self.offload_dir = offload_dir
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        self.result = {
            "rss": resident_bytes(),
            "file_rss": resident_file_bytes(self.offload_dir),
            "state_bytes": storage_bytes(state),
            "weight": full(module.mid.weight.detach()).clone(),
        }


def main() -> None:
    out_dir = Path(sys.argv[1])
    spec = read_payload(out_dir)
    pl.seed_everything(0)
    record = Record(str(spec["offload_dir"]))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=spec["world_size"],
        strategy=spec["strategy"].for_trainer(),
        max_steps=2,
        callbacks=[record],
        **QUIET,
    )
    trainer.fit(Classifier(hidden=spec["hidden"]))
    save_results(out_dir, trainer.global_rank, record.result)


if __name__ == "__main__":
    main()
