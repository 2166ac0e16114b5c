"""Loss curves of every stage over ``"ddp"``'s, training the example GPT: ZeRO changes where state lives, not the
training.

Run from the repository root: ``python -m benchmarks.bench_loss [--steps 60] [--size tiny] [--world-size 2]``.

``--world-size`` CPU processes (started the torchrun way by ``tests/launch.py``) train ``example_modules.gpt``'s
``GPTLanguageModel`` on its Markov-chain tokens, as ``example_modules/configs/zero2.yaml`` does, under ``"ddp"``,
``"zero1"``, ``"zero2"`` and ``"zero3"`` in turn: the same seed, data, AdamW and learning-rate schedule, fp32. Every
rank records the loss of each of its optimizer steps; the table gives rank 0's at a few steps and, per stage, the
largest difference from ``"ddp"``'s over all steps and ranks. The differences are those of summation order: the
stages reduce gradients in buckets or units (and on CPU through shared memory), DDP in its own buckets.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import lightning_zero  # noqa: F401  (registers the strategy names)
from benchmarks import _charts
from benchmarks._ranks import run_ranks, save_rank_results
from example_modules.gpt import GPTLanguageModel, MarkovTokenData

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


class Losses(Callback):
    """The loss of every optimizer step on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def train(strategy: str, args: argparse.Namespace, world_size: int) -> list[float]:
    pl.seed_everything(0, verbose=False)
    losses = Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=args.steps,
        callbacks=[losses], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(GPTLanguageModel(size=args.size), MarkovTokenData(size=args.size, batch_size=args.batch_size))
    return losses.losses


def worker(args: argparse.Namespace) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # Lightning's teardown removes them
    results = {strategy: train(strategy, args, world_size) for strategy in STRATEGIES}
    save_rank_results(args.out_dir, rank, results)
    dist.barrier()
    dist.destroy_process_group()


def table(ranks: list[dict[str, list[float]]], args: argparse.Namespace) -> list[str]:
    shown = sorted({0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
    lines = [
        f"| strategy | {' | '.join(f'loss at step {s + 1}' for s in shown)} | largest difference from ddp |",
        f"|---|{'---|' * (len(shown) + 1)}",
    ]
    for strategy in STRATEGIES:
        losses = ranks[0][strategy]
        gap = max(abs(a - b) for r in ranks for a, b in zip(r[strategy], r["ddp"], strict=True))
        lines.append(f"| {strategy} | {' | '.join(f'{losses[s]:.6f}' for s in shown)} | {gap:.2e} |")
    return lines


def chart(ranks: list[dict[str, list[float]]], args: argparse.Namespace) -> None:
    """Rank 0's loss per step under each strategy, and each stage's distance from ``"ddp"``'s."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, (curves, gaps) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=(2, 1))
    steps = range(1, args.steps + 1)
    for strategy in STRATEGIES:
        style = {"linewidth": 4, "alpha": 0.35} if strategy == "ddp" else {"linewidth": 1}
        curves.plot(steps, ranks[0][strategy], color=_charts.color(strategy), label=strategy, **style)
        if strategy != "ddp":
            gap = [a - b for a, b in zip(ranks[0][strategy], ranks[0]["ddp"], strict=True)]
            largest = max(abs(g) for g in gap)
            gaps.plot(steps, gap, color=_charts.color(strategy), label=f"{strategy}: largest {largest:.1e}")
    title = f"Example GPT ({args.size}), {len(ranks)} ranks, fp32 AdamW: every stage on ddp's curve"
    curves.set(ylabel="training loss (rank 0)", title=title)
    curves.legend(fontsize=8)
    low, high = gaps.get_ylim()
    reach = max(abs(low), abs(high), 1e-6)  # differences of 0 show as a line on 0, not as a zoom into nothing
    gaps.set(xlabel="optimizer step", ylabel="loss - ddp's loss", ylim=(-reach, reach))
    gaps.legend(fontsize=8)
    for axes in (curves, gaps):
        axes.grid(alpha=0.3)
    _charts.save(figure, args.chart, f"{_charts.cpu()} (CPU ranks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each run")
    parser.add_argument("--size", default="tiny", help="the example GPT's size")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--world-size", type=int, default=2, help="CPU processes")
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    _charts.add_chart_argument(parser, "loss")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    argv = ["--steps", str(args.steps), "--size", args.size, "--batch-size", str(args.batch_size)]
    ranks = run_ranks("benchmarks.bench_loss", argv, args.world_size)
    print(f"Training loss of the example GPT ({args.size}) on {args.world_size} CPU processes, fp32:\n", flush=True)
    print("\n".join(table(ranks, args)), flush=True)
    chart(ranks, args)


if __name__ == "__main__":
    main()
