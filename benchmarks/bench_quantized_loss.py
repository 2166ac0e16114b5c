"""The loss after a few hundred steps with ZeRO++'s quantized collectives against plain stage 3's spread over seeds.

Run from the repository root: ``python -m benchmarks.bench_quantized_loss [--steps 200] [--seeds 0 1 2]``.

Two simulated nodes of 2 CPU processes (``tests/launch.py`` with ``nodes=2``; the loss does not depend on the links'
speed, so no namespaces are needed) train ``example_modules.gpt``'s ``GPTLanguageModel`` on its Markov-chain tokens
(AdamW, fp32) under plain ``zero3``, ZeRO++ (quantized weights and gradients, the secondary copy within a node) and
hybrid sharding with quantized gradients, each with every seed. The table gives, per way and seed, the mean loss of
rank 0's last 10 steps, the mean over the seeds and whether it lies within plain ``zero3``'s range over them, and the
largest difference from plain ``zero3`` with the same seed beside that range's width.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from benchmarks._ranks import run_ranks, save_rank_results
from benchmarks.bench_loss import Losses
from example_modules.gpt import GPTLanguageModel, MarkovTokenData
from lightning_zero import ZeroStrategy

WAYS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "zero++": {"quantize_weights": True, "quantize_gradients": True, "secondary_group_size": "node"},
    "hybrid+qgZ": {"shard_group_size": "node", "quantize_gradients": True},
}
LAST = 10  # steps averaged at the end


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[float]]] = {}
    for name, options in WAYS.items():
        for seed in args.seeds:
            pl.seed_everything(seed, verbose=False)
            losses = Losses()
            trainer = pl.Trainer(
                accelerator="cpu", devices=2, num_nodes=2, strategy=ZeroStrategy(stage=3, **options),
                max_steps=args.steps, callbacks=[losses], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            )  # fmt: skip
            data = MarkovTokenData(size=args.size, batch_size=args.batch_size)
            trainer.fit(GPTLanguageModel(size=args.size), data)
            results.setdefault(name, {})[str(seed)] = losses.losses
    save_rank_results(args.out_dir, rank, results)
    dist.barrier()


def table(results: dict[str, dict[str, list[float]]], seeds: list[int]) -> list[str]:
    """Per way: each seed's final loss, their mean, whether the mean lies within plain ``zero3``'s range over the
    seeds, and the largest difference from ``zero3`` with the same seed against that range's width."""
    final = {name: {s: statistics.fmean(runs[str(s)][-LAST:]) for s in seeds} for name, runs in results.items()}
    plain = final["zero3"]
    low, high = min(plain.values()), max(plain.values())
    lines = [f"| way | {' | '.join(f'seed {s}' for s in seeds)} | mean | mean within zero3's range |"
             " largest difference from zero3, same seed / the range's width |",
             "|---|" + "---|" * len(seeds) + "---|---|---|"]  # fmt: skip
    for name, by_seed in final.items():
        mean = statistics.fmean(by_seed.values())
        inside = "-" if name == "zero3" else ("yes" if low <= mean <= high else "no")
        worst = max(abs(by_seed[s] - plain[s]) for s in seeds)
        versus = "-" if name == "zero3" else f"{worst:.4f} / {high - low:.4f}"
        losses = " | ".join(f"{by_seed[s]:.4f}" for s in seeds)
        lines.append(f"| {name} | {losses} | {mean:.4f} | {inside} | {versus} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--size", default="tiny", help="the example GPT's size")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    argv = ["--steps", str(args.steps), "--size", args.size, "--batch-size", str(args.batch_size), "--seeds",
            *map(str, args.seeds)]  # fmt: skip
    ranks = run_ranks("benchmarks.bench_quantized_loss", argv, 4, nodes=2, timeout=6 * 3600)
    print(f"Mean loss of rank 0's last {LAST} of {args.steps} steps, example GPT ({args.size}), 2 simulated nodes x 2"
          " CPU processes, fp32:\n")  # fmt: skip
    print("\n".join(table(ranks[0], args.seeds)))


if __name__ == "__main__":
    main()
