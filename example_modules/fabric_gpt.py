"""The GPT of :mod:`example_modules.gpt` trained by a hand-written Fabric loop, under any strategy Fabric resolves, the
ZeRO ones included (``import lightning_zero`` registers them). From the repository root (about 15 s on 2 CPU cores):

    python -m example_modules.fabric_gpt --strategy zero3 --devices 2

Fabric starts one process per device. The loop shows every piece the ZeRO strategies take part in: the model built
inside ``fabric.init_module()`` (under stage 3 on several ranks its parameters are built without memory and each rank
materialises only its shards), ``setup_module`` then the optimizer built on the parameters it left (stage 3's shards)
and ``setup_optimizers``, ``fabric.backward``, ``no_backward_sync`` around all but the last micro-batch of a step, and
``fabric.clip_gradients``. With ``--checkpoint DIR`` the run resumes from ``DIR`` when it holds a checkpoint (written
under any stage, on any number of ranks, by this loop or by the ``Trainer``) and saves to it at the end. Rank 0 prints
``train_loss start=... end=... steps=...`` (the mean of its first and last five losses), as the CLI example does.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.nn import functional as F

import lightning_zero  # noqa: F401  (registers "zero1", "zero2", "zero3", ... in Fabric's registry)
from example_modules.gpt import GPTLanguageModel, MarkovTokenData

WINDOW = 5  # losses averaged for the start and end of the report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="zero3", help="a Fabric strategy name: zero1, zero2, zero3, ddp, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true", help="Fabric's flag: 32-true, bf16-mixed, bf16-true, ...")
    parser.add_argument("--size", default="tiny", help="a GPT size of example_modules.gpt.SIZES")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch on each rank")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradients clipped to this global norm")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, after a 10-step warmup")
    parser.add_argument("--checkpoint", type=Path, help="resume from this directory if it holds one; save to it")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup to the peak, then cosine decay to ``floor`` times the peak at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def next_batch(batches: Any, loader: Any) -> tuple[torch.Tensor, Any]:
    """The next batch of ``batches``, starting the loader over (a new epoch) when it runs out."""
    try:
        return next(batches), batches
    except StopIteration:
        batches = iter(loader)
        return next(batches), batches


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fabric = Fabric(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, precision=args.precision
    )
    fabric.launch()  # starts this script once more per further device, as torchrun would
    fabric.seed_everything(args.seed)

    data = MarkovTokenData(size=args.size, batch_size=args.batch_size, seed=args.seed)
    data.setup("fit")
    loader = fabric.setup_dataloaders(data.train_dataloader())

    with fabric.init_module():
        model = GPTLanguageModel(size=args.size)
        model.configure_model()
    model = fabric.setup_module(model)
    # built on the parameters `setup_module` left in the model: under stage 3, this rank's shards
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, 10, args.steps))
    optimizer = fabric.setup_optimizers(optimizer)

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.checkpoint is not None and args.checkpoint.exists():
        fabric.load(args.checkpoint, state)
        fabric.print(f"resumed from {args.checkpoint} at step {state['step']}")

    model.train()
    batches, losses = iter(loader), []
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            (tokens,), batches = next_batch(batches, loader)  # (batch, seq_len + 1): inputs and next tokens
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        losses.append(loss.item())

    if args.checkpoint is not None:
        fabric.save(args.checkpoint, state)
    if losses:
        window = min(WINDOW, len(losses))
        start, end = sum(losses[:window]) / window, sum(losses[-window:]) / window
        fabric.print(f"train_loss start={start:.4f} end={end:.4f} steps={len(losses)}")


if __name__ == "__main__":
    main()
