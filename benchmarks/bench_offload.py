"""Offload benchmarks: the host optimizer step's speed, and what offload buys on one GPU.

``python benchmarks/bench_offload.py step [--params 100e6 --rounds 5]``: Adam on a shard of ``--params`` fp32
parameters held in host memory, stepped the way an offloaded ZeRO rank steps (the engine's ``ZeroOptimizer`` over
host masters: torch's fused CPU kernels, then the updated masters copied into the module's weights), against
``torch.optim.Adam`` with its defaults on the same number of plain parameters (on the CPU a loop over parameters).
The two alternate over ``--rounds`` rounds so machine noise hits both alike; the table gives parameters updated per
second (median, and min-max).

``python benchmarks/bench_offload.py capacity [--layers 16 --configs ...]`` (needs a CUDA GPU): trains a residual
MLP of ``--layers`` x 67 M fp32 parameters (1.07 B by default) for 4 steps on one GPU under plain Lightning,
``"zero2_offload"``, ``"zero3_offload"`` and ``"zero2_offload"`` with a bf16 module on fp32 host masters, each in a
fresh process, and reports peak device and host bytes per parameter, device memory held at points of the first
step, seconds per step after the first, and the largest model those bytes allow on this GPU and host (model state
and the activations of a small batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _charts
import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]


# --- the host step ---------------------------------------------------------------------------------------------------


def _layers(num_params: float, width: int = 1024) -> nn.Module:
    count = max(1, round(num_params / (width * width + width)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(count)))


def _zero_host_optimizer(module: nn.Module) -> Any:
    """The engine of one offloaded rank (stage 2) with its wrapped Adam, gradients set on the host shards."""
    from lightning_zero._engine.engine import ZeroEngine
    from lightning_zero._engine.reducers import ReduceScatterReducer
    from lightning_zero._offload.placement import OnHost
    from lightning_zero._transport.mesh import data_parallel_mesh

    mesh = data_parallel_mesh("cpu", 1)
    engine = ZeroEngine(module, ReduceScatterReducer, mesh, 25 * 2**20, placement=OnHost())
    optimizer = engine.shard_optimizer(torch.optim.Adam(module.parameters(), lr=1e-4))
    for sharded in engine.sharded:
        sharded.shard.grad = sharded.wrap(torch.randn_like(sharded.master))
    return optimizer


def _plain_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    for param in module.parameters():
        param.grad = torch.randn_like(param)
    return torch.optim.Adam(module.parameters(), lr=1e-4)


def bench_step(num_params: float, rounds: int, chart: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    contenders = {
        "torch.optim.Adam, defaults": _plain_optimizer(_layers(num_params)),
        "lightning_zero host step (offload)": _zero_host_optimizer(_layers(num_params)),
    }
    numel = sum(p.numel() for p in next(iter(contenders.values())).param_groups[0]["params"])
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for optimizer in contenders.values():  # warm-up: the first step allocates Adam's state
        optimizer.step()
    for round_ in range(rounds):
        names = list(contenders)
        for name in names[round_ % 2 :] + names[: round_ % 2]:
            start = time.perf_counter()
            contenders[name].step()
            seconds[name].append(time.perf_counter() - start)
    print(f"Adam step on {numel / 1e6:.1f} M fp32 parameters, {torch.get_num_threads()} threads, {rounds} rounds\n")
    print("| step | M params/s (median) | M params/s (min-max) | ratio |")
    print("|---|---|---|---|")
    baseline = numel / statistics.median(seconds["torch.optim.Adam, defaults"])
    for name, times in seconds.items():
        rates = sorted(numel / t / 1e6 for t in times)
        median = numel / statistics.median(times)
        print(f"| {name} | {median / 1e6:.1f} | {rates[0]:.1f}-{rates[-1]:.1f} | {median / baseline:.2f}x |")
    dist.destroy_process_group()
    rates = {name: sorted(numel / t / 1e6 for t in times) for name, times in seconds.items()}
    step_chart(rates, f"Adam step on {numel / 1e6:.1f} M fp32 parameters, {torch.get_num_threads()} threads", chart)


def step_chart(rates: dict[str, list[float]], title: str, path: Path) -> None:
    """Parameters updated per second by each step: the median as a bar, the rounds' range as a line."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(8, 2.8))
    baseline = statistics.median(next(iter(rates.values())))
    for y, sorted_rates in enumerate(rates.values()):
        median = statistics.median(sorted_rates)
        spread = [[median - sorted_rates[0]], [sorted_rates[-1] - median]]
        axes.barh(y, median, xerr=spread, color=("#7f7f7f", "#ff7f0e")[y % 2], edgecolor="black", capsize=4)
        axes.text(sorted_rates[-1], y, f"  {median:,.1f} ({median / baseline:.2f}x)", va="center", fontsize=8)
    axes.set_yticks(range(len(rates)), list(rates))
    lowest, highest = min(r[0] for r in rates.values()), max(r[-1] for r in rates.values())
    axes.set(xlabel="M parameters updated per second (median; range over rounds), log scale", title=title,
             xscale="log", xlim=(lowest / 2, highest * 4))  # fmt: skip
    axes.grid(axis="x", alpha=0.3)
    _charts.save(figure, path, f"{_charts.cpu()}")


# --- one GPU: bytes per parameter with and without offload -----------------------------------------------------------

CONFIGS = {  # name: (table label, options)
    "plain": ("plain (no ZeRO), fp32", {"strategy": "auto", "precision": "32-true"}),
    "zero2_offload": ("zero2_offload, fp32", {"strategy": "zero2_offload", "precision": "32-true"}),
    "zero3_offload": ("zero3_offload, fp32", {"strategy": "zero3_offload", "precision": "32-true"}),
    "zero2_offload_bf16": (
        "zero2_offload, bf16 module + fp32 host masters",
        {"strategy": "zero2_offload", "precision": "bf16-true", "master_weights": True},
    ),
}


def _host_peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def trial(config: str, width: int, layers: int) -> dict[str, Any]:
    """Train the residual MLP under ``config`` for 4 steps in this process; peak bytes and median seconds of the
    steps after the first."""
    import lightning.pytorch as pl

    import lightning_zero
    from lightning_zero.pytorch.strategy import ZeroStrategy

    options = dict(CONFIGS[config][1])
    strategy: Any = options.pop("strategy")
    precision = options.pop("precision")
    if options:
        strategy = ZeroStrategy(stage=2, offload_optimizer=True, **options)
    assert lightning_zero

    class Residual(pl.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "layers"):
                self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = batch
            for layer in self.layers:
                x = x + torch.tanh(layer(x))
            return x.float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-5)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(64, width), batch_size=16)

    seconds: list[float] = []  # of each training step, forward to the end of the optimizer step
    held: dict[str, float] = {}  # GiB allocated on the device at points of the first step

    class Clock(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            torch.cuda.synchronize()
            self.started = time.perf_counter()
            held.setdefault("start", torch.cuda.memory_allocated() / 2**30)

        def on_before_optimizer_step(self, *_: Any) -> None:
            held.setdefault("backward", torch.cuda.memory_allocated() / 2**30)

        def on_train_batch_end(self, *_: Any) -> None:
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - self.started)
            held.setdefault("step", torch.cuda.memory_allocated() / 2**30)

    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
    )
    module = Residual()
    trainer.fit(module)
    return {
        "params": layers * (width * width + width),
        "device_peak": torch.cuda.max_memory_allocated(),
        "host_peak": _host_peak_bytes(),
        "step_seconds": statistics.median(seconds[1:]),  # the first step allocates
        "held_gib": held,
    }


def bench_capacity(width: int, layers: int, configs: list[str], chart: Path) -> None:
    device_total = torch.cuda.get_device_properties(0).total_memory
    host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows, measured = [], {}
    for config in configs:
        done = subprocess.run(
            [sys.executable, __file__, "trial", "--config", config, "--width", str(width), "--layers", str(layers)],
            capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            failure = next((line for line in reversed(done.stderr.splitlines()) if "Error" in line), "no output")
            rows.append(f"| {CONFIGS[config][0]} | failed: {failure.strip()[:160]} | | | | |")
            continue
        result = json.loads(lines[-1])
        params = result["params"]
        device_per, host_per = result["device_peak"] / params, result["host_peak"] / params
        largest = min(device_total / device_per, host_total / host_per) / 1e9
        bound = "GPU" if device_total / device_per < host_total / host_per else "host"
        measured[CONFIGS[config][0]] = (device_per, host_per, largest, bound)
        held = " / ".join(f"{result['held_gib'][k]:.1f}" for k in ("start", "backward", "step"))
        rows.append(
            f"| {CONFIGS[config][0]} | {device_per:.2f} | {held} | {host_per:.2f} | {result['step_seconds']:.2f} |"
            f" {largest:.1f} B ({bound} memory) |"
        )
    name = torch.cuda.get_device_name(0)
    print(f"{name}: {device_total / 2**30:.0f} GiB GPU, {host_total / 2**30:.0f} GiB host;"
          f" residual MLP of {layers * (width * width + width) / 1e9:.2f} B parameters, Adam, batch 16\n")
    print(
        "| configuration | device bytes/param (peak) | device GiB held: start / after backward / after step"
        " | host bytes/param (peak RSS) | s/step | largest model |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    title = f"{layers * (width * width + width) / 1e9:.2f} B-parameter residual MLP, Adam, on one GPU"
    capacity_chart(measured, title, f"{name}, {device_total / 2**30:.0f} GiB; {host_total / 2**30:.0f} GiB host", chart)


def capacity_chart(measured: dict[str, tuple[float, float, float, str]], title: str, device: str, path: Path) -> None:
    """Bytes per parameter on the device and on the host for each configuration, and the largest model they allow."""
    plt = _charts.pyplot()
    if plt is None or not measured:
        return
    figure, (per_param, largest) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = list(measured)[::-1]
    for y, name in enumerate(names):
        device_per, host_per, billions, bound = measured[name]
        per_param.barh(y + 0.2, device_per, 0.4, color="#2ca02c", edgecolor="black", label="GPU" if y == 0 else None)
        per_param.barh(y - 0.2, host_per, 0.4, color="#1f77b4", edgecolor="black", label="host" if y == 0 else None)
        largest.barh(y, billions, color="#2ca02c" if bound == "GPU" else "#1f77b4", edgecolor="black")
        largest.text(billions, y, f"  {billions:.1f} B ({bound} memory)", va="center", fontsize=8)
    per_param.set_yticks(range(len(names)), names)
    per_param.set(xlabel="bytes per parameter (peak)")
    per_param.legend(fontsize=8)
    largest.set(xlabel="largest model, billions of parameters", xlim=(0, max(m[2] for m in measured.values()) * 1.5))
    for axes in (per_param, largest):
        axes.grid(axis="x", alpha=0.3)
    figure.suptitle(title)
    _charts.save(figure, path, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    step = sub.add_parser("step")
    step.add_argument("--params", type=float, default=100e6)
    step.add_argument("--rounds", type=int, default=5)
    _charts.add_chart_argument(step, "offload_step")
    capacity = sub.add_parser("capacity")
    capacity.add_argument("--width", type=int, default=8192)
    capacity.add_argument("--layers", type=int, default=16)
    capacity.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    _charts.add_chart_argument(capacity, "offload_capacity")
    one = sub.add_parser("trial")
    one.add_argument("--config", choices=list(CONFIGS), required=True)
    one.add_argument("--width", type=int, required=True)
    one.add_argument("--layers", type=int, required=True)
    args = parser.parse_args()
    match args.command:
        case "step":
            bench_step(args.params, args.rounds, args.chart)
        case "capacity":
            bench_capacity(args.width, args.layers, args.configs, args.chart)
        case "trial":
            print(json.dumps(trial(args.config, args.width, args.layers)))


if __name__ == "__main__":
    main()
