"""``zero_auto`` against every candidate named by hand, on 2 CPU ranks inside memory groups (cgroups, root).

A matrix of model sizes and memory limits; in each cell every candidate (``zero1`` ... ``zero3_infinity``) and
``zero_auto`` train the same MLP for a few steps in a memory group of their own limited to the cell's limit (page
cache included, as a cluster's job limit counts it). A row per cell says whether ``zero_auto`` trained, what it
picked, which candidates trained and which of them was the fastest (median seconds per step after the first two),
the pick's seconds per step over the fastest's, and whether the pick was as fast: within ``AS_FAST`` of it (the same
run repeated on a shared machine moves by a tenth, so a pick within that is as fast as can be told). A candidate that
failed under a limit is not run again for a larger model under it: it would fail again (its state only grows).

``python -m benchmarks.bench_auto`` (root); ``--layers`` and ``--limits`` change the matrix.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._ranks import run_ranks, save_rank_results
from tests import memory_group

GIB = 1024**3
RANKS = 2
WIDTH = 1024  # one layer: 1,049,600 parameters
CANDIDATES = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_infinity"]
TIMEOUT = 300
AS_FAST = 1.10  # a pick's seconds per step over the fastest's within which it counts as the fastest


class Stack(pl.LightningModule):
    """Linear layers of ``WIDTH`` in a ``ModuleList`` (stage 3's units), built in ``configure_model``."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers_count = layers
        self.layers: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(self.layers_count))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        assert self.layers is not None
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, WIDTH)), batch_size=8)


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *_: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        self.times.append(time.perf_counter() - self.start)


def worker(args: argparse.Namespace) -> None:
    from lightning_zero import ZeroAutoStrategy

    strategy: Any = args.way
    if args.way == "zero3_infinity":
        from lightning_zero import Zero3Strategy

        strategy = Zero3Strategy(offload_parameters="disk", offload_optimizer="disk", offload_dir=args.files_dir)
    elif args.way == "zero_auto":
        strategy = ZeroAutoStrategy(offload_dir=args.files_dir)
    times = StepTimes()
    trainer = pl.Trainer(
        accelerator="cpu", devices=RANKS, strategy=strategy, max_steps=args.steps, callbacks=[times], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Stack(args.layers[0]))
    chosen = trainer.strategy.auto_choice.name if args.way == "zero_auto" else args.way
    steady = times.times[2:] or times.times[-1:]  # the first steps build buffers and state
    save_rank_results(args.out_dir, trainer.global_rank, {"step": statistics.median(steady), "chosen": chosen})


def run(way: str, layers: int, limit: float, steps: int) -> dict[str, Any] | str:
    """The rank-0 results of ``way`` in a group limited to ``limit`` GiB, or why it failed."""
    with tempfile.TemporaryDirectory(prefix="bench_auto-") as files_dir:
        argv = ["--worker", "--way", way, "--layers", str(layers), "--steps", str(steps), "--files-dir", files_dir]
        with memory_group.joined(int(limit * GIB)) as group:
            try:
                return run_ranks("benchmarks.bench_auto", argv, RANKS, timeout=TIMEOUT)[0]
            except (RuntimeError, TimeoutError) as error:
                failure = error
        if group.oom_kills:
            return "OOM-killed"
        lines = str(failure).splitlines()
        return next((line.strip()[:80] for line in reversed(lines) if "Error" in line), "failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--files-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 24, 64], help="model sizes, in layers of ~1 M")
    parser.add_argument("--limits", type=float, nargs="+", default=[1.25, 1.75, 2.5], help="memory limits (GiB)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    reason = memory_group.unavailable_reason()
    if reason is not None:
        sys.exit(f"bench_auto needs memory groups: {reason}")
    lines = [
        "| model (M params, fp32 Adam state) | limit (GiB) | zero_auto | picked | trained (s/step) | fastest |"
        " pick / fastest | pick as fast |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for limit in args.limits:
        failed: set[str] = set()
        for layers in args.layers:
            params = layers * (WIDTH * WIDTH + WIDTH)
            results = {way: run(way, layers, limit, args.steps) for way in CANDIDATES if way not in failed}
            failed |= {way for way, result in results.items() if isinstance(result, str)}
            trained = {way: r["step"] for way, r in results.items() if not isinstance(r, str)}
            auto = run("zero_auto", layers, limit, args.steps)
            fastest = min(trained, key=trained.__getitem__) if trained else "-"
            picked = auto["chosen"] if isinstance(auto, dict) else "-"
            listed = ", ".join(f"{way} {seconds:.2f}" for way, seconds in trained.items()) or "none"
            ratio = trained[picked] / trained[fastest] if picked in trained else None
            lines.append(
                f"| {params / 1e6:.0f} ({16 * params / GIB:.2f} GiB) | {limit} |"
                f" {'trained' if isinstance(auto, dict) else auto} | {picked} | {listed} | {fastest} |"
                f" {'-' if ratio is None else f'{ratio:.2f}'} |"
                f" {'-' if ratio is None else 'yes' if ratio <= AS_FAST else 'no'} |"
            )
            print(lines[-1], flush=True)
    print(f"\n{os.uname().nodename}, {os.cpu_count()} CPUs, torch {torch.__version__}, lightning {pl.__version__}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
