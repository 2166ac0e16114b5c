"""Tokens/s, peak device memory and model FLOPs utilisation of every stage on one GPU, against DDP and Lightning's
own sharded strategies, training the example GPT.

Run from the repository root on a machine with a CUDA GPU: ``python -m benchmarks.bench_gpu [--sizes gpt2-small
gpt2-medium] [--rounds 3] [--out table.md]``. ``--device cpu --sizes tiny --precision 32-true --steps 3 --warmup 1
--rounds 1`` runs the same code on the CPU in seconds, to check the script, not to measure.

Every measurement is one run in a process of its own (a fresh CUDA context, so one strategy's cached blocks and peak
never reach another's): ``Trainer(devices=1)``, random tokens, ``--warmup`` untimed optimizer steps, then ``--steps``
steps each timed between two ``torch.cuda.synchronize()``; the run's figure is the median step. Strategies are
interleaved over ``--rounds`` (the order rotates each round), and the table shows the median over rounds:

- ``ddp``: Lightning's ``"ddp"``, one process;
- ``zero1``, ``zero2``, ``zero3``: this package with ``sharded_on_one_device=True``, so the ZeRO path runs (buckets,
  collectives, DTensor shards, ``fully_shard``) instead of plain training, as it does on every GPU of a larger job;
- ``fsdp``: Lightning's ``FSDPStrategy`` (``FULL_SHARD``, each GPT block a unit);
- ``deepspeed2``, ``deepspeed3``: Lightning's ``DeepSpeedStrategy`` stages 2 and 3, where ``deepspeed`` is importable.

MFU is model FLOPs (6 per parameter per token, plus attention's 12 x layers x width x sequence) per second over the
device's dense bf16 peak (``--peak-tflops``, else from the device name for the H100 and H200).

A run that outlasts ``--run-timeout`` seconds is stopped and reported as a stall, so one strategy that hangs leaves the
others' figures. ``--profile DIR`` also records the timed steps of each run with ``torch.profiler`` and writes, per
strategy and size, the operators that took the most device time and the most host time (``DIR/<size>-<strategy>.txt``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from benchmarks import _charts
from example_modules.gpt import SIZES, Block, GPTLanguageModel

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "deepspeed2", "deepspeed3")
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense, SXM


def make_strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name.startswith("zero"):
        return lightning_zero.ZeroStrategy(stage=int(name[-1]), sharded_on_one_device=True)
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    if name.startswith("deepspeed"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(name[-1]))
    raise ValueError(f"Unknown strategy {name!r}. HINT: pick from {STRATEGIES}.")


def available(name: str) -> bool:
    return not name.startswith("deepspeed") or importlib.util.find_spec("deepspeed") is not None


class StepTimer(pl.Callback):
    """Wall time of each optimizer step after ``warmup``, between device synchronisations."""

    def __init__(self, warmup: int, synchronize: Any) -> None:
        self.warmup, self.synchronize = warmup, synchronize
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.synchronize()
        if trainer.global_step > self.warmup:
            self.seconds.append(time.perf_counter() - self._start)


class StepProfiler(pl.Callback):
    """``torch.profiler`` over the steps after ``warmup``; the top operators by device and by host time to ``path``."""

    def __init__(self, warmup: int, path: Path) -> None:
        self.warmup, self.path = warmup, path
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.running = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and not self.running:
            self.profiler.start()
            self.running = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.running:
            return
        self.profiler.stop()
        averages = self.profiler.key_averages()
        device_key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.path.write_text(
            f"by device time ({device_key}):\n{averages.table(sort_by=device_key, row_limit=30)}\n"
            f"by host time (self_cpu_time_total):\n{averages.table(sort_by='self_cpu_time_total', row_limit=30)}\n"
        )


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One strategy, one size, in this process: median step seconds and peak device bytes."""
    shape = SIZES[args.size]
    cuda = args.device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    steps = args.warmup + args.steps
    torch.manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (steps * args.batch_size, shape.seq_len + 1))
    data = DataLoader(TensorDataset(tokens), batch_size=args.batch_size)
    timer = StepTimer(args.warmup, synchronize)
    callbacks: list[pl.Callback] = [timer]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        callbacks.append(StepProfiler(args.warmup, args.profile / f"{args.size}-{args.run}.txt"))
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=make_strategy(args.run),
        precision=args.precision,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPTLanguageModel(size=args.size, warmup_steps=1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, train_dataloaders=data)
    return {
        "step_s": statistics.median(timer.seconds),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "params": parameter_count(args.size),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def parameter_count(size: str) -> int:
    """Parameters of the GPT of ``size``, the tied matrix once, built on the meta device (no memory)."""
    model = GPTLanguageModel(size=size)
    with torch.device("meta"):
        model.configure_model()
    return sum(p.numel() for p in model.parameters())


def flops_per_token(size: str, params: int) -> float:
    shape = SIZES[size]
    return 6 * params + 12 * shape.n_layer * shape.d_model * shape.seq_len


def peak_flops(device: str, given: float | None) -> float | None:
    if given is not None:
        return given * 1e12
    return next((tflops * 1e12 for name, tflops in PEAK_BF16_TFLOPS.items() if name in device), None)


def measure(args: argparse.Namespace, size: str, strategy: str, out: Path) -> dict[str, Any] | None:
    """Run one measurement in a fresh process; ``None`` where it failed (its output is printed)."""
    argv = [
        sys.executable, "-m", "benchmarks.bench_gpu", "--run", strategy, "--size", size, "--json", str(out),
        "--device", args.device, "--precision", args.precision, "--batch-size", str(args.batch_size),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    if args.profile is not None:
        argv += ["--profile", str(args.profile)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=args.run_timeout
        )
    except subprocess.TimeoutExpired as stalled:
        output = (stalled.stdout or b"")[-3000:], (stalled.stderr or b"")[-3000:]
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part for part in output)
        print(f"{strategy} at {size} stalled: stopped after --run-timeout {args.run_timeout:g} s:\n{text}")
        return None
    if done.returncode != 0:
        print(f"{strategy} at {size} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return None
    return json.loads(out.read_text())


def table(args: argparse.Namespace, results: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    lines = [
        "| size | strategy | tokens/s (median) | ratio to ddp | ratio to fsdp | peak GiB | MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in args.sizes:
        tokens = args.batch_size * SIZES[size].seq_len
        rate = {
            s: tokens / statistics.median(r["step_s"] for r in runs) for (z, s), runs in results.items() if z == size
        }
        for (z, strategy), runs in results.items():
            if z != size:
                continue
            peak = peak_flops(runs[0]["device"], args.peak_tflops)
            mfu = f"{rate[strategy] * flops_per_token(size, runs[0]['params']) / peak:.1%}" if peak else "n/a"
            ratios = [f"{rate[strategy] / rate[base]:.3f}" if base in rate else "n/a" for base in ("ddp", "fsdp")]
            gib = max(r["peak_bytes"] for r in runs) / 2**30
            lines.append(f"| {size} | {strategy} | {rate[strategy]:,.0f} | {' | '.join(ratios)} | {gib:.2f} | {mfu} |")
    return "\n".join(lines)


def chart(args: argparse.Namespace, results: dict[tuple[str, str], list[dict[str, Any]]], device: str) -> None:
    """Tokens/s and peak device memory of each strategy at each size, from the table's numbers."""
    plt = _charts.pyplot()
    if plt is None or not results:
        return
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for axes, value, label in (
        (speed, lambda size, runs: args.batch_size * SIZES[size].seq_len / statistics.median(r["step_s"] for r in runs),
         "tokens/s (median)"),
        (memory, lambda size, runs: max(r["peak_bytes"] for r in runs) / 2**30, "peak device memory, GiB"),
    ):  # fmt: skip
        labels = []
        for (size, strategy), runs in results.items():
            axes.bar(len(labels), value(size, runs), color=_charts.color(strategy), edgecolor="black")
            labels.append(f"{strategy}\n{size}")
        axes.set_xticks(range(len(labels)), labels, fontsize=7, rotation=90)
        axes.set(ylabel=label)
        axes.grid(axis="y", alpha=0.3)
    figure.suptitle(f"The example GPT on one device, {args.precision}, batch {args.batch_size}")
    _charts.save(figure, args.chart, _charts.cpu() if device == "cpu" else device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["gpt2-small", "gpt2-medium"], choices=list(SIZES))
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="a comma-separated subset")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps before them")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense peak for --precision, for MFU")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--profile", type=Path, help="write each run's top operators into this folder")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # in a measuring process: the strategy
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    _charts.add_chart_argument(parser, "gpu")
    args = parser.parse_args()
    if args.run is not None:
        args.json.write_text(json.dumps(run_one(args)))
        return
    strategies = [s for s in args.strategies.split(",") if available(s)]
    skipped = sorted(set(args.strategies.split(",")) - set(strategies))
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = strategies[round_index % len(strategies) :] + strategies[: round_index % len(strategies)]
            for size in args.sizes:
                for strategy in order:
                    got = measure(args, size, strategy, Path(tmp) / f"{size}-{strategy}-{round_index}.json")
                    if got is not None:
                        results.setdefault((size, strategy), []).append(got)
                        # each figure as it comes, so a run cut short by its time limit still reports
                        rate = args.batch_size * SIZES[size].seq_len / got["step_s"]
                        gib = got["peak_bytes"] / 2**30
                        print(f"{size} {strategy} round {round_index}: {rate:,.0f} tokens/s, {gib:.2f} GiB", flush=True)
    results = {key: results[key] for size in args.sizes for s in strategies if (key := (size, s)) in results}
    device = next(iter(results.values()))[0]["device"] if results else args.device
    header = (
        f"{device}, {args.precision}, batch {args.batch_size} x sequence of each size, {args.steps} timed steps"
        f" after {args.warmup}, median of {args.rounds} interleaved rounds"
        + (f"; not importable here: {', '.join(skipped)}" if skipped else "")
    )
    text = header + "\n\n" + table(args, results)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    chart(args, results, device)


if __name__ == "__main__":
    main()
