"""Steps/s of "zero3" under Fabric on 2 CPU ranks with the stall watchdog running and stopped
(``lightning_zero._watchdog``): blocks of steps, the watchdog's state alternating from block to block and
the order rotating each pair, in one pair of processes, so that machine noise hits both alike. Rank 0 prints a
markdown row: the median steps/s of each state and their difference, then every block's figure.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/bench_watchdog.py [--blocks 8]``; with
``LIGHTNING_ZERO_SHM_DISABLE=1`` over gloo's point-to-point exchanges instead of shared memory.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric import Fabric
from torch import nn

from lightning_zero._watchdog import watchdog
from lightning_zero.fabric import ZeroStrategy

WARMUP = 5


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, memory_report=False))
    fabric.launch()  # starts the watchdog with the process group
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)])
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    batch = torch.randn(16, args.width)

    def steps(count: int) -> None:
        for _ in range(count):
            fabric.backward(model(batch).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    steps(WARMUP)
    rates: dict[str, list[float]] = {"with": [], "without": []}
    for block in range(args.blocks):
        for state in ("with", "without") if block % 2 == 0 else ("without", "with"):
            if state == "without":
                watchdog.stop()  # the thread ends (joined) at its next tick
            else:
                watchdog.begin_run(block + 1, watchdog.DEFAULT_STALL_AFTER, on_group_gone=lambda: None)
            dist.barrier()
            began = time.perf_counter()
            steps(args.steps)
            dist.barrier()
            rates[state].append(args.steps / (time.perf_counter() - began))
    watchdog.stop()
    if rank == 0:
        transport = "gloo" if os.environ.get("LIGHTNING_ZERO_SHM_DISABLE") == "1" else "shared memory"
        on, off = statistics.median(rates["with"]), statistics.median(rates["without"])
        blocks = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(rates["with"], rates["without"], strict=True))
        print("| transport | with the watchdog (steps/s) | without | difference | blocks (with/without) |")
        print("|---|---|---|---|---|")
        print(f"| {transport} | {on:.2f} | {off:.2f} | {100 * (on / off - 1):+.1f}% | {blocks} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each state")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--width", type=int, default=512, help="width of each layer")
    parser.add_argument("--layers", type=int, default=6, help="layers, each a stage-3 unit")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
