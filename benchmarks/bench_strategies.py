"""Steps/s and per-rank model-state memory of "ddp", "zero1", "zero2", "zero3" and a hand-wrapped FSDP2 peer training
one model on CPU processes.

Run with the package installed (``pip install -e .``): ``python benchmarks/bench_strategies.py [--rounds 5 ...]``.

With no ``RANK`` in the environment the script starts ``--world-size`` copies of itself the way torchrun does, so that
every ``Trainer(devices=N)`` in them joins one gloo group and Lightning never relaunches itself; under ``torchrun`` it
runs as a worker directly. Every worker trains the same seeded model under every strategy, interleaved over rounds
(the order rotates each round) so that machine noise hits all strategies alike. Rank 0 prints a markdown table.

Memory is counted by walking tensors, deduplicated by storage, never from RSS:

- parameters: the module's parameters (after the last step, so stage 3's are its shards);
- gradients, right after backward of the last step: ``param.grad`` and, for ZeRO, the shards' gradient storage and
  the buckets' persistent buffers;
- optimizer state, after the last step: the local tensors of the optimizer's state.

ZeRO's pooled communication buffers (stage 2's staging buffers, both stages' all-gather buffers) are kept between
steps and reported on their own. DDP's C++ reducer keeps flat bucket buffers too (another 4 Psi bytes with the default
``gradient_as_bucket_view=False``); Python cannot reach them, so they are not counted. Stage 3 (``fully_shard``) frees
its all-gather and reduce-scatter buffers within each step, so it keeps no pool between steps; the default wrap policy
makes each residual block a unit, gathered only around its forward and backward.

The peer, "fsdp2 (hand-wrapped)", is what a user gets without this package: Lightning's ``ModelParallelStrategy``
(data parallel over every rank, no tensor parallelism) with a ``configure_model`` that applies ``fully_shard`` to the
same units zero3 picks by default (each residual block) and then to the root. Its memory is counted like zero3's. One
difference besides the wrapping code: on gloo, zero3 swaps ``fully_shard``'s all-gather and reduce-scatter for this
package's (shared memory between the processes of one host, ``lightning_zero._transport.shared_memory``), while the
peer keeps gloo's own collectives over TCP loopback. zero1 and zero2 use the same shared-memory collectives; DDP keeps
gloo's. ``LIGHTNING_ZERO_SHM_DISABLE=1`` runs the package on gloo point-to-point exchanges instead.

``--strategies ddp,zero3,fsdp2`` runs a subset ("fsdp2" is the peer); ddp is always among them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import Zero1Strategy, Zero2Strategy, Zero3Strategy
from lightning_zero.memory import engine_of, storage_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script too: the repository's packages
from benchmarks import _charts
from tests.launch import launch as launch_ranks

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DDPStrategy,
    "zero1": Zero1Strategy,
    "zero2": Zero2Strategy,
    "zero3": Zero3Strategy,
}
PEER = "fsdp2 (hand-wrapped)"  # Lightning's ModelParallelStrategy around HandShardedMLP
NAMES = [*STRATEGIES, PEER]
MIB = 2**20
PHASES = {  # the parts of a training step that Probe times, and what they hold
    "forward": "forward",
    "backward": "backward + grad reduction",
    "step": "optimizer step (+ stage 1/2 gather)",
    "between": "data + loop",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps before them")
    parser.add_argument("--rounds", type=int, default=5, help="runs of every strategy; steps/s is their median")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the residual MLP")
    parser.add_argument("--layers", type=int, default=7, help="residual blocks of the MLP")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size, for DDP and ZeRO alike")
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (torchrun's count wins)")
    parser.add_argument("--profile", action="store_true", help="after the rounds, profile one run per strategy")
    parser.add_argument("--strategies", default=",".join(STRATEGIES) + ",fsdp2", help="comma-separated subset")
    _charts.add_chart_argument(parser, "strategies")
    parser.add_argument("--report", type=Path, help="where rank 0 writes its report (stdout if not given)")
    args = parser.parse_args(argv)
    chosen = [PEER if name == "fsdp2" else name for name in args.strategies.split(",")]
    unknown = sorted(set(chosen) - set(NAMES))
    if unknown or "ddp" not in chosen:
        parser.error(f"--strategies={args.strategies}: pick ddp and any of {', '.join([*STRATEGIES, 'fsdp2'])}")
    args.strategies = [name for name in NAMES if name in chosen]
    for name in ("steps", "warmup", "rounds", "hidden", "layers", "batch_size", "world_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    return args


# --- the model ----------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.linear(self.norm(x)))


class ResidualMLP(pl.LightningModule):
    """A classifier of ``layers`` residual blocks, trained with Adam on random data made in-process."""

    def __init__(self, hidden: int, layers: int, batch_size: int, num_batches: int, d_in: int = 256) -> None:
        super().__init__()
        self.batch_size, self.num_batches, self.d_in, self.classes = batch_size, num_batches, d_in, 16
        self.stem = nn.Linear(d_in, hidden)
        self.blocks = nn.Sequential(*(Block(hidden) for _ in range(layers)))
        self.head = nn.Linear(hidden, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        # enough samples for every rank's steps once Lightning's DistributedSampler splits them
        n = self.batch_size * self.num_batches * self.trainer.world_size
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(n, self.d_in, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, self.classes, (n,), generator=gen)), self.batch_size)


class HandShardedMLP(ResidualMLP):
    """The same model, sharded by hand the way ``ModelParallelStrategy`` asks: ``fully_shard`` on each residual block
    (the units zero3's default policy picks), then on the root."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


# --- measuring ----------------------------------------------------------------------------------------------------


def grad_tensors(strategy: Strategy, module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p.grad for p in module.parameters() if p.grad is not None)
    engine = engine_of(strategy)
    if engine is None:  # DDP, or ZeRO on one process
        return
    for sharded in engine.sharded:
        # the persistent storage the reducer hands shard gradients in (`shard_grad`, a DTensor, in older engines)
        storage = getattr(sharded, "grad_storage", getattr(sharded, "shard_grad", None))
        yield from (g for g in (sharded.shard.grad, storage) if g is not None)
    for bucket in engine.reducer.buckets:
        yield from (t for t in (bucket.buffer, bucket.shard_grads) if t is not None)


def optimizer_state_tensors(strategy: Strategy) -> Iterator[torch.Tensor]:
    for optimizer in strategy.optimizers:
        for state in optimizer.state.values():  # a ZeroOptimizer's is the wrapped optimizer's, keyed by shards
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class Probe(Callback):
    """Stamps the phases of every training step and measures model-state memory at the last step."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.marks: list[dict[str, float]] = []  # per step: perf_counter() at its hooks
        self.memory: dict[str, int] = {}

    def _mark(self, hook: str) -> None:
        self.marks[-1][hook] = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append({})
        self._mark("start")

    def on_before_backward(self, *args: Any) -> None:
        self._mark("backward")

    def on_after_backward(self, *args: Any) -> None:
        self._mark("step")

    def on_train_batch_end(self, *args: Any) -> None:
        self._mark("end")

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.total_steps - 1:  # backward, and its reduction, just finished
            self.memory["grads"] = storage_bytes(grad_tensors(trainer.strategy, module))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # still inside fit: the strategy's teardown drops the engine and its buffer pool
        self.memory["params"] = storage_bytes(module.parameters())
        self.memory["optimizer"] = storage_bytes(optimizer_state_tensors(trainer.strategy))
        engine = engine_of(trainer.strategy)
        self.memory["pool"] = engine.pool.nbytes() if engine is not None else 0

    def steps_per_second(self, warmup: int) -> float:
        """Over the steps after ``warmup``: from the end of the last warm-up step to the end of the last step."""
        return (len(self.marks) - warmup) / (self.marks[-1]["end"] - self.marks[warmup - 1]["end"])

    def phase_ms(self, warmup: int) -> dict[str, float]:
        """Median milliseconds of each phase of the steps after ``warmup``."""
        spans: dict[str, list[float]] = {phase: [] for phase in PHASES}
        for before, step in pairwise(self.marks[warmup - 1 :]):
            spans["forward"].append(step["backward"] - step["start"])  # Lightning zeroes gradients in here too
            spans["backward"].append(step["step"] - step["backward"])
            spans["step"].append(step["end"] - step["step"])
            spans["between"].append(step["start"] - before["end"])
        return {phase: 1e3 * statistics.median(times) for phase, times in spans.items()}


class Profile(Callback):
    """Profiles the steps after the warm-up; ``table`` lists the ops that took the most time."""

    def __init__(self, warmup: int, steps: int) -> None:
        schedule = torch.profiler.schedule(wait=warmup - 1, warmup=1, active=steps)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule)

    def on_train_start(self, *args: Any) -> None:
        self.profiler.start()

    def on_train_batch_end(self, *args: Any) -> None:
        self.profiler.step()

    def on_train_end(self, *args: Any) -> None:
        self.profiler.stop()

    def table(self) -> str:
        return self.profiler.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60)


# --- one worker ---------------------------------------------------------------------------------------------------


def make_strategy(name: str, args: argparse.Namespace) -> Strategy:
    if name == PEER:
        return ModelParallelStrategy(data_parallel_size=args.world_size, tensor_parallel_size=1)
    return STRATEGIES[name](bucket_cap_mb=args.bucket_cap_mb)  # DDPStrategy hands it on to DDP


def fit(name: str, args: argparse.Namespace, callbacks: list[Callback]) -> ResidualMLP:
    total = args.warmup + args.steps
    pl.seed_everything(0, verbose=False)
    model_class = HandShardedMLP if name == PEER else ResidualMLP
    module = model_class(args.hidden, args.layers, args.batch_size, total)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=make_strategy(name, args),
        max_steps=total,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module)
    return module


def measure(name: str, round_index: int, args: argparse.Namespace) -> dict[str, Any]:
    probe = Probe(args.warmup + args.steps)
    module = fit(name, args, [probe])
    return dict(
        strategy=name,
        round=round_index,
        steps_per_s=probe.steps_per_second(args.warmup),
        phase_ms=probe.phase_ms(args.warmup),
        num_params=sum(p.numel() for p in module.parameters()),
        **probe.memory,
    )


def worker(args: argparse.Namespace) -> None:
    args.world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment
    results = []
    for round_index in range(args.rounds):
        names = args.strategies
        shift = round_index % len(names)
        results += [measure(name, round_index, args) for name in names[shift:] + names[:shift]]
    everyone: list[list[dict[str, Any]]] = [[] for _ in range(args.world_size)]
    dist.all_gather_object(everyone, results)
    lines = [report(everyone, args)]
    if dist.get_rank() == 0:
        chart(everyone, args)
    if args.profile:
        for name in args.strategies:
            profile = Profile(args.warmup, args.steps)
            fit(name, args, [profile])
            lines.append(f"\n### profile of {name}, rank 0, {args.steps} steps\n\n{profile.table()}")
    if dist.get_rank() == 0:
        if args.report is None:
            print("\n".join(lines), flush=True)
        else:
            args.report.write_text("\n".join(lines) + "\n")
    # every rank done before gloo is torn down: a process exiting with it alive, or while a peer still talks, can abort
    dist.barrier()
    dist.destroy_process_group()


# --- the report ---------------------------------------------------------------------------------------------------


Runs = dict[tuple[str, int], list[dict[str, Any]]]  # (strategy, round) -> every rank's result


def report(everyone: list[list[dict[str, Any]]], args: argparse.Namespace) -> str:
    runs: Runs = {}
    for rank_results in everyone:
        for result in rank_results:
            runs.setdefault((result["strategy"], result["round"]), []).append(result)
    psi, n = everyone[0][0]["num_params"], len(everyone)
    names = args.strategies
    tables = [*summary_table(runs, names, args.rounds), "", *phase_table(runs, names)]
    return "\n".join([*tables, "", *setup_lines(psi, n, args)])


def summary_table(runs: Runs, names: list[str], rounds: int) -> list[str]:
    """Steps/s is the median over rounds of the slowest rank; its ratios to DDP and to the peer are medians of the
    same-round ratios (pairing cancels noise that drifts between rounds); memory is the largest rank's, in the last
    round."""
    speed = {key: min(r["steps_per_s"] for r in ranks) for key, ranks in runs.items()}

    def ratio(name: str, base: str) -> str:
        if base not in names:
            return "-"
        return f"{statistics.median(speed[name, r] / speed[base, r] for r in range(rounds)):.3f}"

    lines = [
        "| strategy | steps/s (median) | steps/s (min-max) | ratio to ddp | ratio to fsdp2 peer | params MiB/rank"
        " | grads MiB/rank | optimizer state MiB/rank | ZeRO comm pool MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        speeds = [speed[name, r] for r in range(rounds)]
        mem = {k: max(r[k] for r in runs[name, rounds - 1]) / MIB for k in ("params", "grads", "optimizer", "pool")}
        lines.append(
            f"| {name} | {statistics.median(speeds):.2f} | {min(speeds):.2f}-{max(speeds):.2f}"
            f" | {ratio(name, 'ddp')} | {ratio(name, PEER)} | {mem['params']:.1f} | {mem['grads']:.1f}"
            f" | {mem['optimizer']:.1f} | {mem['pool']:.1f} |"
        )
    return lines


def phase_ms(runs: Runs, name: str) -> list[float]:
    """Milliseconds per step in each phase: the median over every rank and round of each run's median."""
    results = [r for (strategy, _), ranks in runs.items() if strategy == name for r in ranks]
    return [statistics.median(r["phase_ms"][phase] for r in results) for phase in PHASES]


def phase_table(runs: Runs, names: list[str]) -> list[str]:
    lines = [
        f"| ms/step | {' | '.join(PHASES.values())} | sum |",
        f"|---|{'---|' * (len(PHASES) + 1)}",
    ]
    for name in names:
        ms = phase_ms(runs, name)
        lines.append(f"| {name} | {' | '.join(f'{t:.1f}' for t in ms)} | {sum(ms):.1f} |")
    return lines


def chart(everyone: list[list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Where each strategy's step time goes (the phase table), beside what a rank holds (the memory columns)."""
    plt = _charts.pyplot()
    if plt is None:
        return
    runs: Runs = {}
    for rank_results in everyone:
        for result in rank_results:
            runs.setdefault((result["strategy"], result["round"]), []).append(result)
    names = args.strategies[::-1]  # top to bottom in the order given
    figure, (time_axes, memory_axes) = plt.subplots(1, 2, figsize=(10, 4.8), sharey=True)
    for parts, axes, shades, unit in (
        ({name: phase_ms(runs, name) for name in names}, time_axes, list(PHASES.values()), "ms per step (median)"),
        (
            {name: [max(r[k] for r in runs[name, args.rounds - 1]) / MIB for k in ("params", "grads", "optimizer",
                                                                                  "pool")] for name in names},
            memory_axes,
            ["parameters", "gradients", "optimizer state", "ZeRO comm pool"],
            "MiB per rank (largest rank)",
        ),
    ):  # fmt: skip
        for y, name in enumerate(names):
            left = 0.0
            for i, value in enumerate(parts[name]):
                axes.barh(y, value, left=left, color=_charts.color(name), alpha=1.0 - 0.22 * i, edgecolor="black",
                          linewidth=0.5)  # fmt: skip
                left += value
        axes.set(xlabel=unit, xlim=(0, max(sum(p) for p in parts.values()) * 1.05))
        legend = [plt.Rectangle((0, 0), 1, 1, facecolor="#555555", alpha=1.0 - 0.22 * i) for i in range(len(shades))]
        axes.legend(legend, shades, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        axes.grid(axis="x", alpha=0.3)
    time_axes.set_yticks(range(len(names)), names)
    psi, n = everyone[0][0]["num_params"], len(everyone)
    figure.suptitle(f"Residual MLP, Psi = {psi / 1e6:.1f} M fp32, Adam, batch {args.batch_size} per rank, N = {n}")
    _charts.save(figure, args.chart, f"{_charts.cpu()} (CPU ranks)")


def setup_lines(psi: int, n: int, args: argparse.Namespace) -> list[str]:
    mib = {k: k * psi / MIB for k in (4, 8)}
    return [
        f"Model: residual MLP ({args.layers} blocks of width {args.hidden}), Psi = {psi:,} fp32 parameters, Adam;"
        f" world size N = {n}; batch size {args.batch_size} per rank; {args.rounds} rounds of {args.warmup} warm-up"
        f" + {args.steps} timed steps; bucket cap {args.bucket_cap_mb:g} MiB.",
        f"Expected per rank: params 4 Psi = {mib[4]:.1f} MiB (ddp, zero1, zero2) vs 4 Psi/N = {mib[4] / n:.1f} MiB"
        f" (zero3, fsdp2); grads 4 Psi = {mib[4]:.1f} MiB (ddp, zero1) vs 4 Psi/N = {mib[4] / n:.1f} MiB (zero2,"
        f" zero3, fsdp2); Adam state 8 Psi = {mib[8]:.1f} MiB (ddp) vs 8 Psi/N = {mib[8] / n:.1f} MiB (zero1, zero2,"
        " zero3, fsdp2); stage 3 and fsdp2 pad each parameter's shard to whole rows.",
    ]


# --- the launcher -------------------------------------------------------------------------------------------------


def launch(world_size: int, argv: list[str]) -> int:
    """Start ``world_size`` workers as torchrun would, with the test suite's launcher (every rank stopped on the first
    failure, each one's output shown then); print rank 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.md"
        launch_ranks("benchmarks.bench_strategies", [*argv, "--report", str(report)], world_size, timeout=24 * 3600)
        print(report.read_text(), flush=True)
    return 0


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(args.world_size, sys.argv[1:]))
    worker(args)


if __name__ == "__main__":
    main()
