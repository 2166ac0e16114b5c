"""Model-state bytes per rank of "ddp", "zero1", "zero2" and "zero3", measured after training, against the ZeRO paper.

Run from the repository root with the package installed (``pip install -e .``):
``python -m benchmarks.bench_memory [--world-sizes 2 4] [--hidden 1024] [--layers 4]``.

For every world size N the launcher starts N processes with ``tests/launch.py`` (the torchrun way, so every
``Trainer(devices=N)`` in them joins one gloo group). Each process trains the same seeded MLP with Adam on random data
for ``--steps`` optimizer steps under each mode below, then, after ``fit`` returns, measures what its rank holds with
``lightning_zero.memory.measure`` (tensors walked and deduplicated by storage, never RSS) and writes it to a JSON file
the launcher turns into one markdown table per N. The formulas are those of Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models" (2020), for Psi parameters and Adam (K = 12):

- ``ddp`` at ``32-true``: fp32 parameters, gradients and two Adam moments, all whole: 16 Psi. DDP runs with
  ``gradient_as_bucket_view=True``, so that its gradients *are* its reducer's buckets; with the default ``False`` the
  C++ reducer keeps another 4 Psi of buckets that no Python tensor reaches.
- ``zero1`` / ``zero2`` with ``master_weights=True`` at ``bf16-true`` (the paper's mixed precision): bf16 parameters
  (2 Psi), bf16 gradients whole (2 Psi, stage 1) or sharded (2 Psi/N, stage 2), and an fp32 master and Adam state
  for this rank's shard only (12 Psi/N): 4 Psi + 12 Psi/N and 2 Psi + 14 Psi/N.
- ``zero3`` at ``bf16-mixed``: fp32 parameter shards, fp32 gradient shards and Adam state for them (bf16 only inside
  autocast): 16 Psi/N.

At rest the gradients of the last step are still held (Lightning clears them at the next step). With fp32 masters the
optimizer stepped on fp32 copies of this rank's gradient shards (``shard.grad``), which live until that same
``zero_grad``; ``measure`` does not count them, so the table lists them in a column of their own.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import _charts
from benchmarks._ranks import run_ranks, save_rank_results
from lightning_zero import ZeroStrategy
from lightning_zero.memory import engine_of, measure, storage_bytes

MIB = 2**20
D_IN = 256  # input features of the MLP
CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state")


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One row of the table: how to train, and what the ZeRO paper says a rank then holds."""

    label: str
    """The row's name in the table."""
    precision: str
    """``Trainer(precision=...)``."""
    strategy: Callable[[], Strategy]
    """Builds a fresh strategy for each ``fit``."""
    formula: str
    """The paper's model-state bytes per rank, as printed."""
    bytes_per_param: Callable[[int], float]
    """The same formula divided by Psi, given N."""


MODES = (
    Mode(
        label="ddp, fp32 (32-true)",
        precision="32-true",
        strategy=lambda: DDPStrategy(gradient_as_bucket_view=True),
        formula="16 Psi",
        bytes_per_param=lambda n: 16,
    ),
    Mode(
        label="zero1 + fp32 master (bf16-true)",
        precision="bf16-true",
        strategy=lambda: ZeroStrategy(stage=1, master_weights=True),
        formula="4 Psi + 12 Psi/N",
        bytes_per_param=lambda n: 4 + 12 / n,
    ),
    Mode(
        label="zero2 + fp32 master (bf16-true)",
        precision="bf16-true",
        strategy=lambda: ZeroStrategy(stage=2, master_weights=True),
        formula="2 Psi + 14 Psi/N",
        bytes_per_param=lambda n: 2 + 14 / n,
    ),
    Mode(
        label="zero3 (bf16-mixed)",
        precision="bf16-mixed",
        strategy=lambda: ZeroStrategy(stage=3),
        formula="16 Psi/N",
        bytes_per_param=lambda n: 16 / n,
    ),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="process counts N, one table each")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the MLP")
    parser.add_argument("--layers", type=int, default=4, help="hidden square layers of the MLP")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps before measuring")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)  # set by the launcher for its workers
    _charts.add_chart_argument(parser, "memory")
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "steps", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if any(n < 2 for n in args.world_sizes):
        parser.error(f"--world-sizes {args.world_sizes}: ZeRO shards over at least 2 processes")
    return args


# --- the model ----------------------------------------------------------------------------------------------------


class MLP(pl.LightningModule):
    """An MLP classifier (GELU between ``layers`` square hidden layers) trained with Adam on random data. Its 10-row
    head splits unevenly over 4 ranks (3, 3, 3, 1 rows), so the padding of uneven shards shows up there."""

    def __init__(self, hidden: int, layers: int, batch_size: int, steps: int, d_in: int = D_IN) -> None:
        super().__init__()
        self.batch_size, self.steps, self.d_in, self.classes = batch_size, steps, d_in, 10
        hidden_layers = [module for _ in range(layers) for module in (nn.Linear(hidden, hidden), nn.GELU())]
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), *hidden_layers, nn.Linear(hidden, self.classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        n = self.batch_size * self.steps * self.trainer.world_size  # every rank's steps, after the sampler splits
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(n, self.d_in, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, self.classes, (n,), generator=gen)), self.batch_size)


def num_params(args: argparse.Namespace) -> int:
    return sum(p.numel() for p in MLP(args.hidden, args.layers, args.batch_size, args.steps).parameters())


# --- one worker ---------------------------------------------------------------------------------------------------


def train_and_measure(mode: Mode, args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """Bytes this rank holds after ``fit`` under ``mode``, by category, and its fp32 gradient copies."""
    pl.seed_everything(0, verbose=False)
    module = MLP(args.hidden, args.layers, args.batch_size, args.steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=mode.strategy(),
        precision=mode.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module)
    engine = engine_of(trainer.strategy)  # stages 1 and 2 only
    state = measure(module, trainer.optimizers, engine)
    # With a master dtype each shard's gradient is handed to the optimizer as an fp32 copy, kept until `zero_grad`.
    sharded = [] if engine is None else engine.sharded
    copies = [s.shard.grad for s in sharded if s.has_master and s.shard.grad is not None]
    return {**asdict(state), "total": state.total, "grad_copies": storage_bytes(copies)}


def worker(args: argparse.Namespace) -> None:
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment
    rank = int(os.environ["RANK"])
    results = {mode.label: train_and_measure(mode, args, world_size) for mode in MODES}
    save_rank_results(args.out_dir, rank, results)
    # every rank done before gloo is torn down: a process exiting while a peer still talks can abort
    dist.barrier()
    dist.destroy_process_group()


# --- the report ---------------------------------------------------------------------------------------------------


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f}"


def largest_total(ranks: list[dict[str, dict[str, int]]], mode: Mode) -> int:
    """The model-state bytes of the rank that holds the most under ``mode`` (the one a memory limit is about)."""
    return max(r[mode.label]["total"] for r in ranks)


def chart(measured: dict[int, list[dict[str, dict[str, int]]]], psi: int, path: Path) -> None:
    """Per-rank MiB against N: each mode's formula as a line, the measured largest rank as points on it."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(8, 4.5))
    ns = sorted(measured)
    line = range(1, max(ns) * 2 + 1)
    for mode in MODES:
        name = mode.label.split(" ")[0].rstrip(",")
        axes.plot(line, [mode.bytes_per_param(n) * psi / MIB for n in line], color=_charts.color(name), alpha=0.5,
                  label=f"{mode.label}: {mode.formula}")  # fmt: skip
        axes.plot(ns, [largest_total(measured[n], mode) / MIB for n in ns], "o", color=_charts.color(name))
    title = f"Model state per rank, Psi = {psi / 1e6:.2f} M, Adam: measured (points), formulas (lines)"
    axes.set(xlabel="N (ranks)", ylabel="model state per rank (MiB)", xticks=list(line), ylim=(0, None), title=title)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    _charts.save(figure, path, f"{_charts.cpu()} (CPU ranks, gloo)")


def table(ranks: list[dict[str, dict[str, int]]], psi: int) -> list[str]:
    """One row per mode, for the rank that holds the most (the one a memory limit is about)."""
    n = len(ranks)
    lines = [
        "| strategy / mode | params MiB | grads MiB | master MiB | optimizer state MiB | total per rank MiB"
        " | formula | formula MiB | measured/formula (excess) | ranks' totals MiB"
        " | fp32 grad copies MiB (not in total) | (total + copies)/formula |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        per_rank = [r[mode.label] for r in ranks]
        worst = max(range(n), key=lambda r: per_rank[r]["total"])
        held = per_rank[worst]
        expected = mode.bytes_per_param(n) * psi
        totals = sorted(r["total"] for r in per_rank)
        lines.append(
            f"| {mode.label} | {' | '.join(mib(held[c]) for c in CATEGORIES)} | {mib(held['total'])} (rank {worst})"
            f" | {mode.formula} = {mode.bytes_per_param(n):.2f} Psi | {mib(expected)}"
            f" | {held['total'] / expected:.4f} ({held['total'] - expected:+,.0f} B)"
            f" | {mib(totals[0])}-{mib(totals[-1])} | {mib(held['grad_copies'])}"
            f" | {(held['total'] + held['grad_copies']) / expected:.4f} |"
        )
    return lines


def notes(psi: int, args: argparse.Namespace) -> list[str]:
    return [
        f"Psi = {psi:,} parameters: an MLP of Linear {D_IN}->{args.hidden}, {args.layers} x Linear {args.hidden}->"
        f"{args.hidden} and Linear {args.hidden}->10 with GELU between; Adam (lr 1e-4); {args.steps} optimizer steps"
        f" of {args.batch_size} random samples per rank, so Adam's moments exist.",
        "Measured on every rank after `trainer.fit` returned (training over, stage 1/2 engine detached, its"
        " communication pool freed), with the last step's gradients still held: `lightning_zero.memory.measure`,"
        " tensors walked and deduplicated by storage. The row shows the rank with the largest total.",
        "Small excesses over the formula are padding: a parameter whose rows do not split evenly gives the first"
        " ranks ceil(rows/N) rows (more than Psi/N), stage 2's gradient chunks and stage 3's shards are padded to"
        " ceil(rows/N) rows on every rank, the stage 1/2 gradient buckets carry one presence flag per parameter, and"
        " Adam keeps a 4-byte `step` tensor per parameter (per shard).",
        "ddp uses `gradient_as_bucket_view=True`: with DDP's default the C++ reducer holds another 4 Psi of gradient"
        " buckets that no Python tensor reaches. Not model state and not counted for any row: activations, and"
        " buffers freed within a step (stage 3's gathered units, stage 2's staging buffers).",
        "The copies column checks a transient: with fp32 masters the optimizer steps on fp32 copies of this rank's"
        " gradient shards (4 Psi/N), which `measure` does not count; they are freed right after the step.",
    ]


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    psi = num_params(args)
    measured = {}
    for world_size in args.world_sizes:
        ranks = run_ranks("benchmarks.bench_memory", _worker_argv(args), world_size)
        measured[world_size] = ranks
        print(f"\n### N = {world_size} processes, Psi = {psi:,} parameters\n", flush=True)
        print("\n".join(table(ranks, psi)), flush=True)
    print("\n" + "\n\n".join(notes(psi, args)), flush=True)
    chart(measured, psi, args.chart)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    return [
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
    ]


if __name__ == "__main__":
    main()
