"""Bytes that cross nodes per step under hybrid sharding (``shard_group_size="node"``) against full sharding, counted
in the collectives.

Run from the repository root: ``python -m benchmarks.bench_hybrid [--layouts 2x2 2x4]``.

Each layout ``NxD`` simulates N nodes of D processes on this host (``Trainer(num_nodes=N, devices=D)``, each process
told its node): the MLP of ``benchmarks/bench_communication.py`` trains under each stage, sharded across all ranks or
within each node, and from the second step on every collective counts the bytes this rank sends to ranks of other
nodes, as a direct exchange sends them (``lightning_zero._transport.traffic``: B/n to each peer of a reduce-scatter or
all-gather of B bytes over n ranks, twice that in an all-reduce). Gradients cross in the reduce-scatter (full) or in
the all-reduce of each shard across the groups (hybrid: a buffer 1/D of the size, for twice the traffic of a
reduce-scatter, so 2/D of full sharding's gradient bytes cross for large N); parameter gathers stay within a node.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

from benchmarks import _charts
from benchmarks.bench_communication import MLP
from lightning_zero import ZeroStrategy
from lightning_zero._transport.traffic import TRAFFIC
from tests.launch import launch

STAGES = (1, 2, 3)
SHARDINGS = {"full": None, "hybrid": "node"}


class CrossingMLP(MLP):
    """Records, per step, the bytes sent to other nodes by kind."""

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.step_bytes.append(dict(TRAFFIC.across_nodes))


def worker(args: argparse.Namespace) -> None:
    nodes, devices = int(os.environ["NODES"]), int(os.environ["DEVICES"])
    results = {}
    for stage in STAGES:
        for label, sharding in SHARDINGS.items():
            pl.seed_everything(0, verbose=False)
            module = CrossingMLP(args.width)
            trainer = pl.Trainer(
                accelerator="cpu", devices=devices, num_nodes=nodes, max_steps=4, logger=False,
                strategy=ZeroStrategy(stage=stage, shard_group_size=sharding), enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module)
            results[f"zero{stage}/{label}"] = module.step_bytes[1:]
    if dist.get_rank() == 0:
        psi = sum(p.numel() for p in MLP(args.width).parameters())
        (args.out_dir / "crossing.json").write_text(json.dumps({"psi": psi, "results": results}))
    dist.barrier()


def grads(step: dict[str, int]) -> float:
    """MiB of gradients sent to other nodes: reduce-scattered (full sharding) or all-reduced as shards (hybrid)."""
    return (step.get("reduce_scatter", 0) + step.get("all_reduce", 0)) / 2**20


def gathers(step: dict[str, int]) -> float:
    """MiB of parameters gathered from other nodes."""
    return step.get("all_gather", 0) / 2**20


def table(layouts: dict[str, dict]) -> list[str]:
    lines = [
        "| nodes x devices | stage | gradients MiB: full -> hybrid | parameter gathers MiB: full -> hybrid"
        " | all crossing: hybrid / full |",
        "|---|---|---|---|---|",
    ]
    for layout, data in layouts.items():
        for stage in STAGES:
            full, hybrid = (data["results"][f"zero{stage}/{label}"][0] for label in SHARDINGS)
            ratio = (grads(hybrid) + gathers(hybrid)) / (grads(full) + gathers(full))
            lines.append(
                f"| {layout} | zero{stage} | {grads(full):.2f} -> {grads(hybrid):.2f}"
                f" | {gathers(full):.2f} -> {gathers(hybrid):.2f} | {ratio:.3f} |"
            )
    return lines


def chart(layouts: dict[str, dict], path: Path) -> None:
    """MiB rank 0 sends to other nodes per step, full sharding beside hybrid for each layout and stage, gradients
    and parameter gathers stacked."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(8, 4.5))
    labels, positions, x = [], [], 0.0
    for layout, data in layouts.items():
        for stage in STAGES:
            for offset, label in ((-0.2, "full"), (0.2, "hybrid")):
                step = data["results"][f"zero{stage}/{label}"][0]
                hatch = "//" if label == "hybrid" else None
                color = _charts.color(f"zero{stage}")
                axes.bar(x + offset, grads(step), 0.4, color=color, hatch=hatch, edgecolor="black", linewidth=0.5)
                axes.bar(x + offset, gathers(step), 0.4, bottom=grads(step), color=color, alpha=0.4, hatch=hatch,
                         edgecolor="black", linewidth=0.5)  # fmt: skip
            labels.append(f"zero{stage}\n{layout}")
            positions.append(x)
            x += 1
        x += 0.5
    axes.set_xticks(positions, labels, fontsize=8)
    legend = [
        plt.Rectangle((0, 0), 1, 1, facecolor="#bbbbbb", edgecolor="black"),
        plt.Rectangle((0, 0), 1, 1, facecolor="#bbbbbb", alpha=0.4, edgecolor="black"),
        plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black"),
        plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"),
    ]
    names = ["gradients", "parameter gathers", "full sharding (left)", 'hybrid, shard_group_size="node" (right)']
    axes.legend(legend, names, fontsize=8)
    psi = layouts[next(iter(layouts))]["psi"]
    highest = max(grads(s) + gathers(s) for data in layouts.values() for runs in data["results"].values() for s in runs)
    axes.set(ylabel="MiB rank 0 sends to other nodes per step", ylim=(0, highest * 1.5),
             title=f"Bytes crossing nodes per step (nodes x devices), Psi = {psi:,} fp32 parameters")  # fmt: skip
    axes.grid(axis="y", alpha=0.3)
    _charts.save(figure, path, f"{_charts.cpu()} (nodes simulated by CPU processes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["2x2", "2x4"], help="NODESxDEVICES")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    _charts.add_chart_argument(parser, "hybrid")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    layouts = {}
    for layout in args.layouts:
        nodes, devices = map(int, layout.split("x"))
        os.environ.update(NODES=str(nodes), DEVICES=str(devices))
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--width", str(args.width), "--out-dir", tmp]
            launch("benchmarks.bench_hybrid", argv, nodes * devices, timeout=1800, nodes=nodes)
            layouts[layout] = json.loads((Path(tmp) / "crossing.json").read_text())
    psi = layouts[args.layouts[0]]["psi"]
    print(f"Bytes rank 0 sends to other nodes per step, Psi = {psi:,} fp32 parameters (Psi x 4 B ="
          f" {psi * 4 / 2**20:.2f} MiB):\n", flush=True)
    print("\n".join(table(layouts)), flush=True)
    chart(layouts, args.chart)


if __name__ == "__main__":
    main()
