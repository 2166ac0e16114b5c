"""Communication volume per training step of each stage, counted in the collectives, against the ZeRO paper, and what
it predicts for step time on N GPUs.

Run from the repository root: ``python -m benchmarks.bench_communication [--world-sizes 2 4]``.

N CPU processes train the same MLP (fp32, Adam) under ``zero1``, ``zero2`` and ``zero3``; from the second step on, every
collective of the package is counted (``lightning_zero._transport.traffic``: a reduce-scatter or all-gather of B bytes
counts B, an all-reduce 2 B, as the paper counts Psi and 2 Psi) and divided by Psi x 4 bytes. The paper says 2 Psi for
stage 1 and 2 (a reduce-scatter of gradients and an all-gather of parameters) and 3 Psi for stage 3 (the parameters
are gathered twice). Here stage 1 keeps full averaged gradients in ``param.grad`` as DDP does, so it all-reduces them
(2 Psi) before gathering the updated shards (Psi): 3 Psi. ``"ddp"`` all-reduces inside its C++ reducer, which Python
cannot count: 2 Psi by construction.

The prediction (``--predict-params``, ``--bytes-per-element``, ``--compute-ms``, ``--bandwidth``): on N GPUs a ring
collective sends (N - 1) / N of its volume over each GPU's link, so a step's communication takes
``V x Psi x bytes x (N - 1) / N / bandwidth``. Gradient reduction overlaps backward (stages 2 and 3 reduce buckets as
they fill; stage 3 prefetches the next unit's gather), the gather after the optimizer step of stages 1 and 2 does
not: the step takes between ``max(compute, comm)`` (all of it hidden) and ``compute + comm`` (none hidden). With a
fixed batch per GPU, compute stays the same as N grows while comm approaches ``V x Psi x bytes / bandwidth``: a stage
stops scaling where that exceeds the compute it can hide behind.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategy names)
from benchmarks import _charts
from lightning_zero._transport.traffic import TRAFFIC
from tests.launch import launch

STRATEGIES = ("zero1", "zero2", "zero3")
PAPER = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3}
KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast")


class MLP(pl.LightningModule):
    """Six residual blocks of width ``width``; every block a unit under stage 3."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6))
        self.head = nn.Linear(width, 10)
        self.step_bytes: list[dict[str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        TRAFFIC.reset()

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.step_bytes.append(dict(TRAFFIC.bytes))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        n = 8 * 4 * self.trainer.world_size
        x = torch.randn(n, self.blocks[0][0].in_features, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=gen)), batch_size=8)


def worker(args: argparse.Namespace) -> None:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = {}
    for strategy in STRATEGIES:
        pl.seed_everything(0, verbose=False)
        module = MLP(args.width)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module)
        results[strategy] = module.step_bytes[1:]  # the first step also broadcasts rank 0's buffers
    if rank == 0:
        psi = sum(p.numel() for p in MLP(args.width).parameters())
        (args.out_dir / "traffic.json").write_text(json.dumps({"psi": psi, "results": results}))
    dist.barrier()


def volume(step: dict[str, int]) -> int:
    """The step's volume in the paper's terms: an all-reduce counts twice its buffer."""
    return step.get("reduce_scatter", 0) + step.get("all_gather", 0) + 2 * step.get("all_reduce", 0)


def measured_table(by_world_size: dict[int, dict]) -> tuple[list[str], dict[str, float]]:
    lines = [
        "| N | strategy | reduce-scatter MiB | all-gather MiB | all-reduce MiB | volume / (Psi x 4 B) | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    multiples: dict[str, float] = {}
    for world_size, data in by_world_size.items():
        psi_bytes = 4 * data["psi"]
        for strategy in STRATEGIES:
            steps = data["results"][strategy]
            assert all(s == steps[0] for s in steps), f"{strategy}: steps moved different bytes: {steps}"
            step = steps[0]
            multiples[strategy] = volume(step) / psi_bytes
            mib = [f"{step.get(kind, 0) / 2**20:.2f}" for kind in KINDS[:3]]
            lines.append(
                f"| {world_size} | {strategy} | {' | '.join(mib)} | {multiples[strategy]:.3f} | {PAPER[strategy]} |"
            )
    return lines, multiples


def chart(by_world_size: dict[int, dict], path: Path) -> None:
    """Each stage's volume per step at each N, one stacked bar per collective kind, in units of Psi x 4 B, beside
    the paper's figure."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(8, 4.5))
    shades = {"reduce_scatter": 1.0, "all_gather": 0.6, "all_reduce": 0.3}
    labels, x = [], 0
    for world_size, data in by_world_size.items():
        psi_bytes = 4 * data["psi"]
        for strategy in STRATEGIES:
            step = data["results"][strategy][0]
            bottom = 0.0
            for kind, alpha in shades.items():
                height = step.get(kind, 0) * (2 if kind == "all_reduce" else 1) / psi_bytes
                axes.bar(x, height, bottom=bottom, color=_charts.color(strategy), alpha=alpha, edgecolor="black",
                         linewidth=0.5)  # fmt: skip
                bottom += height
            axes.hlines(PAPER[strategy], x - 0.4, x + 0.4, colors="black", linestyles="dashed")
            labels.append(f"{strategy}\nN={world_size}")
            x += 1
        x += 0.5
    positions = [i + 0.5 * (i // len(STRATEGIES)) for i in range(len(labels))]
    axes.set_xticks(positions, labels, fontsize=8)
    legend = [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", alpha=a) for a in shades.values()]
    legend.append(plt.Line2D([], [], color="black", linestyle="dashed"))
    names = ["reduce-scatter (B)", "all-gather (B)", "all-reduce (2 B)", "the ZeRO paper"]
    axes.legend(legend, names, fontsize=8, loc="upper left")
    axes.set(ylabel="volume per step / (Psi x 4 B)", ylim=(0, 3.6),
             title=f"Communication per step by collective, Psi = {by_world_size[next(iter(by_world_size))]['psi']:,}"
             " fp32 parameters, Adam")  # fmt: skip
    axes.grid(axis="y", alpha=0.3)
    _charts.save(figure, path, f"{_charts.cpu()} (CPU ranks; counted in the collectives)")


def predicted_table(multiples: dict[str, float], args: argparse.Namespace) -> list[str]:
    volumes = {"ddp": 2.0, **multiples}
    lines = [
        f"Psi = {args.predict_params:.3g}, {args.bytes_per_element} bytes per element, compute {args.compute_ms} ms"
        " per step and GPU (fixed batch per GPU):",
        "",
        "| link GB/s | N | " + " | ".join(f"{s} comm ms (step ms, best-worst)" for s in volumes) + " |",
        "|---|---|" + "---|" * len(volumes),
    ]
    for bandwidth in args.bandwidth:
        for n in args.predict_ranks:
            cells = []
            for multiple in volumes.values():
                comm = multiple * args.predict_params * args.bytes_per_element * (n - 1) / n / (bandwidth * 1e9) * 1e3
                best, worst = max(args.compute_ms, comm), args.compute_ms + comm
                cells.append(f"{comm:.0f} ({best:.0f}-{worst:.0f})")
            lines.append(f"| {bandwidth:g} | {n} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--predict-params", type=float, default=355e6, help="Psi of the model to predict for")
    parser.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16 gradients and gathers")
    parser.add_argument("--compute-ms", type=float, default=300.0, help="measured forward+backward+step per GPU")
    parser.add_argument("--bandwidth", type=float, nargs="+", default=[25.0, 100.0, 450.0], help="GB/s per GPU link")
    parser.add_argument("--predict-ranks", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    _charts.add_chart_argument(parser, "communication")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    by_world_size = {}
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            launch("benchmarks.bench_communication", ["--width", str(args.width), "--out-dir", tmp], world_size)
            by_world_size[world_size] = json.loads((Path(tmp) / "traffic.json").read_text())
    lines, multiples = measured_table(by_world_size)
    psi = by_world_size[args.world_sizes[0]]["psi"]
    print(f"Measured on CPU ranks, Psi = {psi:,} fp32 parameters, Adam:\n", flush=True)
    print("\n".join(lines), flush=True)
    print("\n" + "\n".join(predicted_table(multiples, args)), flush=True)
    chart(by_world_size, args.chart)


if __name__ == "__main__":
    main()
