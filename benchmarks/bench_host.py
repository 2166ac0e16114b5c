"""The host's work per training step: milliseconds a step of each strategy takes when its arithmetic is negligible, so
that what is measured is the framework's own work (hooks, dispatch, copies, collectives, the optimizer's loop).

On a GPU the host must queue a step's kernels faster than the device runs them, or the device waits: at small and mid
sizes the host's work per step decides a strategy's speed. This measures it on any machine. The default model has
GPT-2 small's module structure (12 blocks, the same parameter tensors and wrap units) at width 64, sequence 32,
batch 2 per rank, in fp32 on one thread; ``--size`` takes any of the example GPT's shapes instead.

Run from the repository root: ``python -m benchmarks.bench_host [--world-sizes 1 2] [--rounds 5] [--profile]``.

Every run is a process of its own (``Trainer(accelerator="cpu", devices=N)``, Lightning's launcher starting the other
ranks), with ``--warmup`` untimed steps then ``--steps`` timed ones; a run's figure is its median step, from the
start of a batch to its end (forward, backward, optimizer step). Strategies are interleaved over ``--rounds``, the
order rotating each round, and the table shows the median over rounds, with each strategy's speed against ``ddp``'s
(ddp's milliseconds over the strategy's) in the same run:

- ``ddp``: Lightning's ``"ddp"``;
- ``zero1``, ``zero2``, ``zero3``: this package, with ``sharded_on_one_device=True`` on one rank so that the ZeRO path
  runs as on every device of a larger job;
- ``fsdp2``: ``fully_shard`` by hand, the way Lightning's ``ModelParallelStrategy`` asks (``configure_model`` shards
  each block, then the root), with gloo's collectives.

``--profile`` also samples each rank-0 process's main thread during its timed steps and splits a step's host time
into the framework parts listed in :data:`CATEGORIES` (in milliseconds per step; the sampler's own cost is in the
step times of that run, so profile runs are not timing runs and ``--profile`` runs them after the timed rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script too: the repository's packages
import lightning_zero
from benchmarks import _charts
from example_modules.gpt import Block, GPTLanguageModel, shape_of

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
# Where a sample of the main thread's stack spends its time: the first rule (innermost frame first) whose file or
# function matches names it; a sample that matches none is the model's own arithmetic and the loop's Python.
CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # (file path parts, function names)
    "copies": ((), ("chunk_cat", "foreach_all_gather_copy_out", "foreach_reduce_scatter_copy_in", "_stage", "_unpack")),
    "collectives": (("lightning_zero/_transport/", "distributed_c10d.py", "_functional_collectives"), ()),
    "dispatch": (("torch/distributed/tensor/",), ()),
    "optimizer": (("torch/optim/", "lightning_zero/_offload/local_step.py", "lightning_zero/_engine/gather.py"), ()),
    "hooks": (("torch/distributed/fsdp/", "lightning_zero/_engine/", "lightning_zero/_stage3/", "utils/hooks"), ()),
    "model": (("torch/nn/modules/", "torch/nn/functional.py", "torch/autograd/", "example_modules/"), ()),
    "framework": (("lightning/", "lightning_zero/"), ()),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpt2-host", help="the example GPT's shape (default: gpt2-host)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated; ddp is always run")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], help="ranks per run")
    parser.add_argument("--rounds", type=int, default=5, help="runs of every strategy; the table shows their median")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--profile", action="store_true", help="then one sampled run per strategy and world size")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) to this file")
    _charts.add_chart_argument(parser, "host")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the strategy one process runs
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)  # where rank 0 writes its figures
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.strategies.split(",")
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies={args.strategies}: unknown {unknown}; pick from {', '.join(STRATEGIES)}")
    args.strategies = [name for name in STRATEGIES if name in {"ddp", *names}]
    shape_of(args.size)  # an unknown size fails here, with the known ones
    for name in ("rounds", "steps", "warmup", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    return args


# --- one run --------------------------------------------------------------------------------------------------------


class RandomTokens(GPTLanguageModel):
    """The example GPT on random tokens: every rank draws its own batches from one seeded generator."""

    def __init__(self, size: str, batch_size: int, batches: int) -> None:
        super().__init__(size=size)
        self.batch_size, self.batches = batch_size, batches

    def train_dataloader(self) -> DataLoader:
        shape = self.shape
        count = self.batch_size * self.batches * self.trainer.world_size
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, shape.vocab_size, (count, shape.seq_len + 1), generator=generator)
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size)


class ShardedByHand(RandomTokens):
    """``fully_shard`` applied by hand, as ``ModelParallelStrategy`` asks: each block, then the root."""

    def configure_model(self) -> None:
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            if isinstance(block, Block):
                fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


class HostSampler:
    """Samples the main thread's Python stack every ``interval`` seconds while started, each sample named by
    :data:`CATEGORIES`."""

    def __init__(self, interval: float = 0.0005) -> None:
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self._main = threading.main_thread().ident
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(self.interval / 2)  # the sampler must get the interpreter while the main thread runs
        self._running.set()
        self._thread.start()

    def stop(self) -> None:
        self._running.clear()
        self._thread.join()

    def _run(self) -> None:
        while self._running.is_set():
            frame = sys._current_frames().get(self._main)
            if frame is not None:
                self.counts[category(frame)] += 1
            time.sleep(self.interval)


def category(frame: FrameType | None) -> str:
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        for label, (paths, names) in CATEGORIES.items():
            if name in names or any(part in path for part in paths):
                return label
        frame = frame.f_back
    return "other"


class StepTimes(pl.Callback):
    """Each step's seconds after ``warmup``; with a sampler, samples only those steps."""

    def __init__(self, warmup: int, sampler: HostSampler | None) -> None:
        self.warmup, self.sampler = warmup, sampler
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []  # the process's CPU time, every thread: what others' load leaves alone
        self._start = self._cpu_start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and self.sampler is not None:
            self.sampler.start()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.seconds.append(time.perf_counter() - self._start)
            self.cpu_seconds.append(time.process_time() - self._cpu_start)

    def on_train_end(self, *args: Any) -> None:
        if self.sampler is not None and self.sampler._running.is_set():
            self.sampler.stop()


def make_strategy(name: str, world_size: int) -> Any:
    if name == "ddp":
        return "ddp"
    if name == "fsdp2":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    return lightning_zero.ZeroStrategy(stage=int(name[-1]), sharded_on_one_device=world_size == 1)


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    name = args.worker
    module_class = ShardedByHand if name == "fsdp2" else RandomTokens
    model = module_class(args.size, args.batch_size, args.warmup + args.steps)
    sampler = HostSampler() if args.sample else None
    timer = StepTimes(args.warmup, sampler)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=make_strategy(name, args.world_size),
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model)
    if trainer.global_rank == 0 and args.results is not None:
        steps = len(timer.seconds)
        sampled = {label: count for label, count in (sampler.counts if sampler else Counter()).items()}
        ms, cpu_ms = 1e3 * statistics.median(timer.seconds), 1e3 * statistics.median(timer.cpu_seconds)
        fastest = 1e3 * min(timer.seconds)
        args.results.write_text(json.dumps({"ms": ms, "cpu_ms": cpu_ms, "min_ms": fastest, "steps": steps, **sampled}))


# --- the interleaved runs -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, name: str, world_size: int, sample: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        command = [
            sys.executable, "-m", "benchmarks.bench_host", "--worker", name, "--world-size", str(world_size),
            "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--results", str(results), *(["--sample"] if sample else []),
        ]  # fmt: skip
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=_charts.REPO)
        if done.returncode != 0 or not results.exists():
            raise RuntimeError(f"{name} on {world_size} rank(s) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(results.read_text())


def measure(args: argparse.Namespace) -> dict[tuple[int, str], list[float]]:
    """Milliseconds per step of every strategy at every world size, one figure per round."""
    times: dict[tuple[int, str], list[float]] = {}
    for world_size in args.world_sizes:
        for round_index in range(args.rounds):
            shift = round_index % len(args.strategies)
            for name in args.strategies[shift:] + args.strategies[:shift]:
                ms = run(args, name, world_size)["ms"]
                times.setdefault((world_size, name), []).append(ms)
                print(f"  {world_size} rank(s), round {round_index + 1}: {name} {ms:.1f} ms", file=sys.stderr)
    return times


def speed_against_ddp(times: dict[tuple[int, str], list[float]], world_size: int, name: str) -> float:
    """ddp's milliseconds over ``name``'s, round by round (the same run's neighbours), then their median."""
    ratios = [d / s for d, s in zip(times[(world_size, "ddp")], times[(world_size, name)], strict=True)]
    return statistics.median(ratios)


def table(args: argparse.Namespace, times: dict[tuple[int, str], list[float]]) -> str:
    header = " | ".join(args.strategies)
    lines = [
        f"Host time per step, {args.size}, batch {args.batch_size} per rank, fp32, one thread: median ms over"
        f" {args.rounds} interleaved rounds (speed against ddp, round by round)",
        "",
        f"| ranks | {header} |",
        "|---" * (len(args.strategies) + 1) + "|",
    ]
    for world_size in args.world_sizes:
        cells = []
        for name in args.strategies:
            ms = statistics.median(times[(world_size, name)])
            speed = "" if name == "ddp" else f" ({speed_against_ddp(times, world_size, name):.2f}x)"
            cells.append(f"{ms:.1f}{speed}")
        lines.append(f"| {world_size} | {' | '.join(cells)} |")
    return "\n".join(lines)


def profile_table(args: argparse.Namespace) -> str:
    labels = [*CATEGORIES, "other"]
    lines = [
        "Where a step's host time goes (ms per step, from stack samples of rank 0's main thread; sampled runs are"
        " slower than timed ones)",
        "",
        f"| ranks | strategy | step ms | {' | '.join(labels)} |",
        "|---" * (len(labels) + 3) + "|",
    ]
    for world_size in args.world_sizes:
        for name in args.strategies:
            result = run(args, name, world_size, sample=True)
            total = sum(result.get(label, 0) for label in labels) or 1
            shares = [f"{result['ms'] * result.get(label, 0) / total:.1f}" for label in labels]
            lines.append(f"| {world_size} | {name} | {result['ms']:.1f} | {' | '.join(shares)} |")
    return "\n".join(lines)


def chart(args: argparse.Namespace, times: dict[tuple[int, str], list[float]]) -> None:
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(8, 4.2), dpi=_charts.DPI)
    width = 0.8 / len(args.strategies)
    for index, name in enumerate(args.strategies):
        xs = [w + (index - (len(args.strategies) - 1) / 2) * width for w in range(len(args.world_sizes))]
        ms = [statistics.median(times[(w, name)]) for w in args.world_sizes]
        axis.bar(xs, ms, width, label=name, color=_charts.color(name))
    axis.set_xticks(range(len(args.world_sizes)), [f"{w} rank{'s' if w > 1 else ''}" for w in args.world_sizes])
    axis.set_ylabel("ms per step (median)")
    axis.set_title(f"Host time per step at negligible arithmetic ({args.size})")
    axis.legend()
    _charts.save(figure, args.chart, _charts.cpu())


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    times = measure(args)
    report = table(args, times)
    if args.profile:
        report += "\n\n" + profile_table(args)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")
    chart(args, times)


if __name__ == "__main__":
    main()
