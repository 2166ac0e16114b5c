"""Runs inside each of 2 processes (started by tests/test_preemption.py) as the SLURM tasks of one job with
``SLURMEnvironment(auto_requeue=True)``: per ``(strategy, preemption)`` of the payload's ``cases``, a run in which
every rank (or rank 1 alone) sends itself a signal, or raises, at the :class:`~tests.scenarios.Preemption`'s point of
step ``SIGNAL_AT``, then a run that resumes from what was saved (Lightning's ``hpc_ckpt_<n>.ckpt`` after SIGUSR1,
requeued through the ``scontrol`` on ``PATH``; ``OnExceptionCheckpoint``'s file after SIGTERM or the exception), and
per strategy one run without interruption; each to ``STEPS`` steps.

``python -m tests.workers.preemption OUT``; rank 0 writes ``OUT/results.json``: per case, the largest difference
between the resumed run's final weights and the uninterrupted run's, the step the resumed run started from, the
checkpoints and the hidden entries (a save's staging directory) in its directory, and the losses of both runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.scenarios import Preemption, StrategySpec, cpu_trainer, read_payload
from tests.workers.modules_zero3 import TiedLM, token_data

STEPS = 6
SIGNAL_AT = 3  # global_step while the step runs in which the signal is sent
SAVED_BY_CALLBACK = (Preemption.SIGTERM, Preemption.EXCEPTION)  # OnExceptionCheckpoint's cases: fit raises


class PreemptedLM(TiedLM):
    """The stage-3 test module with a step-wise scheduler, one step per epoch; with ``preemption`` (a
    :class:`Preemption`'s value: hyper-parameters hold plain types), the signal or exception of that case."""

    def __init__(self, preemption: str | None = None) -> None:
        super().__init__(scheduler=True)
        self.preemption = None if preemption is None else Preemption(preemption)
        self.resumed_at: int | None = None
        self.blocks[1].register_forward_hook(self._in_forward)

    def _in_forward(self, *_: Any) -> None:
        if self.training:
            self._at(Preemption.IN_FORWARD)

    def _at(self, point: Preemption) -> None:
        if self.preemption is not point or self.global_step != SIGNAL_AT:
            return
        self.preemption = None  # once
        if point is Preemption.EXCEPTION:
            raise ValueError(f"deliberate failure at step {SIGNAL_AT}")
        if point is not Preemption.RANK1_ONLY or self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM if point is Preemption.SIGTERM else signal.SIGUSR1)

    def on_train_start(self) -> None:
        self.resumed_at = self.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self._at(Preemption.BEFORE_BACKWARD)
        self._at(Preemption.EXCEPTION)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for point in (Preemption.BETWEEN_BACKWARD_AND_STEP, Preemption.RANK1_ONLY, Preemption.SIGTERM,
                      Preemption.SAVE_KILLED):
            self._at(point)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self._at(Preemption.AFTER_STEP)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._at(Preemption.DURING_SAVE)

    def train_dataloader(self) -> DataLoader:
        """One batch per rank: every step is an epoch, so a run resumed at any step sees the data of one that never
        stopped (Lightning restarts a plain data loader's epoch from its start)."""
        hp = self.hparams
        return DataLoader(token_data(2 * hp.batch_size, hp.seq, hp.vocab, 11), batch_size=hp.batch_size)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective under stage 3)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.named_parameters()
    }


def fit(strategy: str, root: Path, preemption: Preemption | None = None, resume: bool = False) -> PreemptedLM:
    callbacks: list[pl.Callback] = []
    if preemption is Preemption.DURING_SAVE:
        callbacks.append(ModelCheckpoint(root / "checkpoints", every_n_train_steps=SIGNAL_AT, save_top_k=-1))
    if preemption in SAVED_BY_CALLBACK:
        callbacks.append(OnExceptionCheckpoint(root))
    pl.seed_everything(0)
    trainer = cpu_trainer(
        StrategySpec(strategy).for_trainer(),
        STEPS,
        default_root_dir=root,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
    )
    module = PreemptedLM(None if resume or preemption is None else preemption.value)
    on_exception = root / "on_exception.ckpt"  # a resumed run finds an hpc_ckpt itself, as Lightning does on SLURM
    try:
        trainer.fit(module, ckpt_path=on_exception if resume and preemption in SAVED_BY_CALLBACK else None)
    except (SIGTERMException, ValueError):
        if resume or preemption not in SAVED_BY_CALLBACK:
            raise
    return module


def die_while_saving(target: Path) -> None:
    """On rank 0, a process that begins a save to ``target`` and exits: its staging directory, with a shard file
    begun, stays as a save killed half-way leaves it; then every rank goes on."""
    if dist.get_rank() == 0:
        code = (
            "import sys; from pathlib import Path; from lightning_zero._checkpoint import publish;"
            " (publish.make_staging_directory(Path(sys.argv[1])) / '__0_0.distcp').write_bytes(b'half a shard')"
        )
        subprocess.run([sys.executable, "-c", code, str(target)], check=True)
    dist.barrier()


def main(out: Path) -> None:
    payload = read_payload(out)
    rank = int(os.environ["RANK"])
    os.environ["SLURM_PROCID"], os.environ["SLURM_LOCALID"] = str(rank), os.environ["LOCAL_RANK"]  # as srun sets them
    truths: dict[str, tuple[PreemptedLM, dict[str, torch.Tensor]]] = {}
    results: dict[str, Any] = {}
    for strategy, preemption in payload["cases"]:
        if strategy not in truths:
            truth = fit(strategy, out / f"{strategy}-uninterrupted")
            truths[strategy] = truth, weights(truth)
        truth, expected = truths[strategy]
        root = out / f"{strategy}-{preemption.value}"
        fit(strategy, root, preemption)
        if preemption is Preemption.SAVE_KILLED:
            die_while_saving(root / "hpc_ckpt_2.ckpt")
        resumed = fit(strategy, root, preemption, resume=True)
        got = weights(resumed)
        results[f"{strategy} {preemption.value}"] = {
            "max_diff": max((got[name] - expected[name]).abs().max().item() for name in expected),
            "resumed_at": resumed.resumed_at,
            "saved": sorted(p.name for p in root.iterdir() if p.name.startswith("hpc_ckpt")),
            "hidden": sorted(p.name for d in (root, root / "checkpoints") if d.is_dir() for p in d.glob(".*")),
            "losses": resumed.losses,
            "uninterrupted_losses": truth.losses,
        }
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
