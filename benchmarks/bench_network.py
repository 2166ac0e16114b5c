"""Two simulated hosts of 2 CPU ranks on a loopback limited to a cluster's bandwidth: plain and hybrid sharding against
ZeRO++'s quantized weights, quantized gradients and secondary copy, side by side in one run.

Run from the repository root, as root: ``python -m benchmarks.bench_network [--rates 1 10] [--steps 8]``.

Inside a private network namespace (``unshare --net``), ``tc qdisc add dev lo root tbf rate <R>gbit burst 256kb
latency 50ms`` limits every byte on the loopback, the only link there; each host is an ``unshare --mount`` with a
``/dev/shm`` of its own, so the shared-memory channel stays within a host as NVLink does, and torchrun joins the two
(``--nnodes 2``) on 127.0.0.1. Each way trains Lightning's demo Transformer on random tokens for ``--steps`` steps and
reports the median seconds per step after the first two, the bytes a rank sends to the other host per step (counted
in the package's collectives; ``ddp``'s are torch's own and not counted) and the last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from benchmarks import _charts
from benchmarks.bench_infinity import DemoTransformer, demo_transformer
from lightning_zero import ZeroStrategy
from lightning_zero._transport.traffic import TRAFFIC

# qwZ: quantized weights; qgZ: quantized gradients; zero++: both and the secondary copy within a host
WAYS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "hybrid": {"stage": 3, "shard_group_size": "node"},
    "zero3+qwZ": {"stage": 3, "quantize_weights": True},
    "zero3+qgZ": {"stage": 3, "quantize_gradients": True},
    "zero++": {
        "stage": 3, "quantize_weights": True, "quantize_gradients": True, "secondary_group_size": "node",
    },
    "hybrid+qgZ": {"stage": 3, "shard_group_size": "node", "quantize_gradients": True},
}  # fmt: skip
PORT = 29561


class Record(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.crossing: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, *_: Any) -> None:
        TRAFFIC.across_nodes.clear()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.crossing.append(sum(TRAFFIC.across_nodes.values()))
        self.losses.append(float(outputs["loss"]))


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, options in WAYS.items():
        if args.ways and name not in args.ways:
            continue
        pl.seed_everything(args.seed, verbose=False)
        record = Record()
        strategy = DDPStrategy() if options is None else ZeroStrategy(**options)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=args.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        )  # fmt: skip
        module = DemoTransformer(args.width, args.layers, args.steps)
        trainer.fit(module)
        results[name] = {
            "s_per_step": statistics.median(record.seconds[2:]),
            "crossing_per_step": statistics.median(record.crossing[2:]) if options is not None else None,
            "loss": record.losses[-1],
        }
    if dist.get_rank() == 0:
        (args.out_dir / "network.json").write_text(json.dumps(results))


def run_rate(rate: float, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Both hosts under one network namespace whose loopback runs at ``rate`` Gbit/s."""
    here = Path(__file__).resolve().parents[1]
    forwarded = ["--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
                 "--seed", str(args.seed), "--out-dir", str(out_dir)]  # fmt: skip
    for way in args.ways:
        forwarded += ["--way", way]
    hosts = []
    for node in range(2):
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(PORT),
               "-m", "benchmarks.bench_network", "--worker", *forwarded]  # fmt: skip
        log = out_dir / f"host{node}.log"
        hosts.append(f"unshare --mount sh -c 'mount -t tmpfs tmpfs /dev/shm && exec {' '.join(run)}' >{log} 2>&1 &")
    script = "\n".join([
        "set -e", "ip link set lo up",
        f"tc qdisc add dev lo root tbf rate {rate}gbit burst 256kb latency 50ms",
        *hosts, "wait",
    ])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(here)}
    subprocess.run(["unshare", "--net", "sh", "-c", script], cwd=here, env=env, check=True, timeout=args.timeout)
    result = out_dir / "network.json"
    if not result.exists():
        logs = "\n".join((out_dir / f"host{n}.log").read_text()[-3000:] for n in range(2))
        raise RuntimeError(f"the run at {rate} Gbit/s wrote no results:\n{logs}")
    return json.loads(result.read_text())


def table(rates: dict[float, dict[str, Any]]) -> list[str]:
    lines = []
    for rate, results in rates.items():
        zero3 = results.get("zero3", {}).get("s_per_step")
        plain_bytes = results.get("zero3", {}).get("crossing_per_step")
        lines += [f"### {rate:g} Gbit/s between the hosts", "",
                  "| way | s/step | steps/s vs zero3 | MiB to the other host, per rank and step | vs zero3 | loss |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in results.items():
            speed = f"{zero3 / r['s_per_step']:.2f}x" if zero3 else "-"
            crossing = r["crossing_per_step"]
            mib = "-" if crossing is None else f"{crossing / 2**20:.1f}"
            share = "-" if crossing is None or not plain_bytes else f"{crossing / plain_bytes:.2f}"
            lines.append(f"| {name} | {r['s_per_step']:.2f} | {speed} | {mib} | {share} | {r['loss']:.4f} |")
        lines.append("")
    return lines


def chart(rates: dict[float, dict[str, Any]], path: Path, params: float) -> None:
    """Seconds per step of each way at each rate, the MiB a rank sends to the other host per step over each bar."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4.5), squeeze=False)
    for axis, (rate, results) in zip(axes[0], rates.items(), strict=True):
        names = list(results)
        seconds = [results[n]["s_per_step"] for n in names]
        bars = axis.bar(range(len(names)), seconds, color=[_charts.color(n) for n in names], edgecolor="black")
        for bar, name in zip(bars, names, strict=True):
            crossing = results[name]["crossing_per_step"]
            if crossing is not None:
                axis.annotate(f"{crossing / 2**20:.0f} MiB", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=7)  # fmt: skip
        axis.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        axis.set_ylabel("seconds per step (lower is better)")
        axis.set_title(f"{rate:g} Gbit/s between 2 hosts of 2 ranks", fontsize=10)
    figure.suptitle(f"demo Transformer, {params / 1e6:.1f} M parameters; over each bar: MiB a rank sends to the other"
                    " host per step", fontsize=9)  # fmt: skip
    _charts.save(figure, path, f"{_charts.cpu()} (hosts simulated by namespaces)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 10.0], help="Gbit/s between the hosts")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--way", dest="ways", action="append", default=[], choices=list(WAYS), help="only these")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--results", type=Path, help="write the results as JSON here; with --redraw, read them")
    parser.add_argument("--redraw", action="store_true", help="only the table and chart of --results")
    _charts.add_chart_argument(parser, "network")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    params = sum(p.numel() for p in demo_transformer(args.width, args.layers).parameters())
    if args.redraw:
        rates = {float(rate): results for rate, results in json.loads(args.results.read_text()).items()}
        print("\n".join(table(rates)))
        chart(rates, args.chart, params)
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("tc") is None:
        raise SystemExit("bench_network needs root, `unshare` and `tc` (iproute2) to make the two hosts' network.")
    rates = {}
    for rate in args.rates:
        with tempfile.TemporaryDirectory() as out:
            rates[rate] = run_rate(rate, args, Path(out))
    if args.results is not None:
        args.results.write_text(json.dumps(rates))
    print("\n".join(table(rates)))
    chart(rates, args.chart, params)
    print(f"demo Transformer: {params / 1e6:.1f} M parameters, width {args.width}, {args.layers}+{args.layers}"
          f" layers; 2 hosts x 2 CPU ranks; {args.steps} steps, median after the first two")


if __name__ == "__main__":
    main()
