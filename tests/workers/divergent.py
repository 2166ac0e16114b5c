"""Runs inside each of 2 processes (started by tests/test_divergent.py): code that differs between the ranks under
ZeRO stage 3, with Hugging Face's GPT-2 (a tiny one, random weights) generating a different number of tokens on each
rank, or a plain module whose forward runs one unit on rank 0 only.

``python -m tests.workers.divergent OUT``, the payload in ``OUT`` holding ``runs``: a list of ``(Divergence, strategy
name, synced_gpus)`` run one after the other (``synced_gpus``: ``None`` leaves it out of the ``generate()`` call).
After each run every rank writes ``OUT/<phase>-<strategy>-<synced>.rank<r>.json``: the token ids it generated, in
order. A run that raises ends the process with its exception, as a user's script would; with ``in_turn`` each run
must end with the ranks' divergence, caught: every rank writes the error it raised instead, and the next run gets a
process group of its own (the channel of a divergence stays broken); with ``rank1_fails_last``
in the payload, rank 1 raises after the last run, once rank 0 has nothing left to do with it; with ``stall_after``,
the ZeRO strategies get that bound of their stall watchdog.

Started without a rank in its environment, it is the job Lightning's launcher makes of ``Trainer(devices=2)``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_zero import ZeroStrategy
from lightning_zero._transport.labels import DivergedError
from tests.scenarios import Divergence, cpu_trainer, new_process_group, read_payload

NEW_TOKENS = (2, 7)  # per rank: rank 0 stops generating first
VOCAB = 64


def run_name(phase: Divergence, strategy: str, synced: bool | None) -> str:
    return f"{phase.value}-{strategy}-{synced}"


class Generating(LightningModule):
    """GPT-2 trained on its own prompts, generating greedily in validation and prediction."""

    def __init__(self, synced: bool | None) -> None:
        super().__init__()
        self.synced = synced
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64)
        self.model = GPT2LMHeadModel(config)
        self.generated: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._generate(batch[0])

    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self._generate(batch[0])

    def _generate(self, prompts: torch.Tensor) -> None:
        synced = {} if self.synced is None else {"synced_gpus": self.synced}
        new = NEW_TOKENS[self.global_rank]
        out = self.model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, **synced)
        self.generated.extend(out.tolist())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Branching(LightningModule):
    """Three blocks, each a unit under stage 3 (entries of a ``ModuleList``); the middle one runs on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index != 1 or self.global_rank == 0:
                x = torch.tanh(block(x))
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def prompts(n: int, seed: int) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, 5), generator=gen)), batch_size=2)


def run(phase: Divergence, name: str, synced: bool | None, stall_after: float | None) -> list[list[int]]:
    seed_everything(0)
    strategy: Any = name
    if stall_after is not None and name != "ddp":
        strategy = ZeroStrategy(stage=int(name.removeprefix("zero")), stall_after=stall_after)
    if phase is Divergence.BRANCH:
        gen = torch.Generator().manual_seed(1)
        data = DataLoader(TensorDataset(torch.randn(8, 8, generator=gen)), batch_size=2)
        cpu_trainer(strategy, max_steps=2).fit(Branching(), data)
        return []
    module = Generating(synced)
    if phase is Divergence.PREDICT:
        cpu_trainer(strategy).predict(module, prompts(4, 1), return_predictions=False)
    elif phase is Divergence.VALIDATE:
        cpu_trainer(strategy).validate(module, prompts(4, 1))
    else:  # validation after the first of two epochs
        trainer = cpu_trainer(strategy, max_epochs=2, num_sanity_val_steps=0)
        trainer.fit(module, prompts(8, 2), prompts(4, 1))
    return module.generated


def in_turn(phase: Divergence, strategy: str, synced: bool | None) -> dict[str, Any]:
    """Run it, expecting the ranks to diverge: the error this rank raised, and how long the run took."""
    began = time.monotonic()
    try:
        run(phase, strategy, synced, None)
    except DivergedError as error:
        return {"error": str(error), "seconds": time.monotonic() - began}
    return {"error": None, "seconds": time.monotonic() - began}


def main(out: Path) -> None:
    payload = read_payload(out)
    for phase, strategy, synced in payload["runs"]:
        if payload.get("in_turn"):
            diverged = in_turn(phase, strategy, synced)
            rank = torch.distributed.get_rank()
            (out / f"{run_name(phase, strategy, synced)}.rank{rank}.json").write_text(json.dumps(diverged))
            new_process_group()
            continue
        generated = run(phase, strategy, synced, payload.get("stall_after"))
        rank = torch.distributed.get_rank()
        (out / f"{run_name(phase, strategy, synced)}.rank{rank}.json").write_text(json.dumps(generated))
    if payload.get("rank1_fails_last") and torch.distributed.get_rank() == 1:
        time.sleep(2)  # rank 0 is at its exit by now
        raise ValueError("rank 1 fails after its last run")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
