"""Runs inside each of N processes: trains a wide classifier under one strategy and records, after training, this
process's resident memory and the bytes of optimizer state it keeps, and, once the gradients of a step are all there,
its resident memory and where the parameter and gradient shards live, for tests/test_offload.py. With ``resume`` in
the payload, the run saves a checkpoint directory and a second run resumes from it for a step; that run records, as
training starts (the checkpoint loaded, no step taken), where the optimizer state lives and this process's resident
memory."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

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


def file_ranges(directory: str) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files under ``directory`` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(directory):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def bytes_in_files(tensors: list[torch.Tensor], directory: str) -> int:
    """Bytes of ``tensors`` (local shards) whose memory lies in a mapping of a file under ``directory``."""
    ranges = file_ranges(directory)
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if t.numel() and any(start <= t.data_ptr() < end for start, end in ranges)
    )


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Record(pl.Callback):
    def __init__(self, offload_dir: str) -> None:
        self.offload_dir = offload_dir
        self.result: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, *_: Any) -> None:
        if "step_rss" in self.result:
            return
        params = [local(p.detach()) for p in module.parameters()]
        grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
        self.result |= {
            "step_rss": resident_bytes(),
            "step_file_rss": resident_file_bytes(self.offload_dir),
            "param_bytes": storage_bytes(params),
            "param_file_bytes": bytes_in_files(params, self.offload_dir),
            "grad_bytes": storage_bytes(grads),
            "grad_file_bytes": bytes_in_files(grads, self.offload_dir),
        }

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        self.result |= {
            "rss": resident_bytes(),
            "file_rss": resident_file_bytes(self.offload_dir),
            "state_bytes": storage_bytes(state),
            "weight": full(module.mid.weight.detach()).clone(),
        }


class Loaded(pl.Callback):
    """Where the optimizer state a resume loaded lives, before the resumed run's first step."""

    def __init__(self, offload_dir: str) -> None:
        self.offload_dir = offload_dir
        self.result: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        state = [local(v) for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim() > 0]
        self.result = {
            "loaded_rss": resident_bytes(),
            "loaded_file_rss": resident_file_bytes(self.offload_dir),
            "loaded_state_bytes": storage_bytes(state),
            "loaded_state_file_bytes": bytes_in_files(state, self.offload_dir),
        }


class SaveAtEnd(pl.Callback):
    """A checkpoint directory as training ends, as a checkpoint callback writes one during training."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def fit(spec: dict[str, Any], steps: int, callbacks: list[pl.Callback], ckpt_path: Path | None = None) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=spec["world_size"],
        strategy=spec["strategy"].for_trainer(),
        max_steps=steps,
        callbacks=callbacks,
        **QUIET,
    )
    trainer.fit(Classifier(hidden=spec["hidden"]), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    out_dir = Path(sys.argv[1])
    spec = read_payload(out_dir)
    record = Record(str(spec["offload_dir"]))
    checkpoint = out_dir / "checkpoint"
    trainer = fit(spec, 2, [record, SaveAtEnd(checkpoint)] if spec.get("resume") else [record])
    rank = trainer.global_rank
    if spec.get("resume"):
        del trainer
        gc.collect()  # the first run's files go with its module and optimizer
        loaded = Loaded(str(spec["offload_dir"]))
        fit(spec, 3, [loaded], checkpoint)
        record.result |= loaded.result
    save_results(out_dir, rank, record.result)


if __name__ == "__main__":
    main()
