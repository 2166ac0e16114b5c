"""Steps/s and per-rank model-state memory of "ddp", "zero1" and "zero2" training one model on CPU processes.

Run from anywhere: ``python benchmarks/bench_strategies.py [--steps 30 --rounds 3 ...]``.

With no ``RANK`` in the environment the script starts ``--world-size`` copies of itself the way torchrun does, so that
every ``Trainer(devices=N)`` in them joins one gloo group and Lightning never relaunches; under ``torchrun`` it runs
as a worker directly. Each worker trains the same seeded model under every strategy, interleaved over rounds (the
order rotates each round) so machine noise hits all strategies alike. Rank 0 prints a markdown table.

Memory is counted by walking tensors, deduplicated by storage, never from RSS:

- parameters: the module's parameters;
- gradients, right after backward of the last step: ``param.grad`` and, for ZeRO, the shards' gradient storage and
  stage 1's persistent bucket buffers;
- optimizer state, after the last step: the local tensors of the optimizer's state.

ZeRO's pooled communication buffers (stage 2's staging buffers, both stages' all-gather buffers) are reported on
their own. DDP's C++ reducer also keeps flat bucket buffers (another 4 Psi bytes with the default
``gradient_as_bucket_view=False``); Python cannot reach them, so they are not counted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script, this file's folder (not the repo) heads sys.path

from lightning_zero import Zero1Strategy, Zero2Strategy  # noqa: E402

STRATEGIES = ("ddp", "zero1", "zero2")
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every strategy; steps/s is their median")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the residual MLP")
    parser.add_argument("--layers", type=int, default=7, help="residual blocks of the MLP")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size, for DDP and ZeRO alike")
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--profile", action="store_true", help="after the rounds, profile one run per strategy")
    return parser.parse_args(argv)


# --- the model --------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.linear(self.norm(x)))


class ResidualMLP(pl.LightningModule):
    """A classifier of ``layers`` residual blocks, trained with Adam on synthetic data made in-process."""

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
        data = TensorDataset(x, torch.randint(0, self.classes, (n,), generator=gen))
        return DataLoader(data, batch_size=self.batch_size)


# --- measuring ----------------------------------------------------------------------------------------------------


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def grad_tensors(strategy: Strategy, module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p.grad for p in module.parameters() if p.grad is not None)
    engine = getattr(strategy, "_engine", None)
    if engine is None:  # DDP, or ZeRO on one process
        return
    for sharded in engine.sharded:
        yield from (g for g in (sharded.shard.grad, sharded.shard_grad) if g is not None)
    for bucket in engine.reducer.buckets:
        yield from (t for t in (bucket.buffer, bucket.shard_grads) if t is not None)


def optimizer_state_tensors(strategy: Strategy) -> Iterator[torch.Tensor]:
    for optimizer in strategy.optimizers:
        for state in optimizer.state.values():  # ZeroOptimizer.state is the wrapped optimizer's, keyed by shards
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class Probe(Callback):
    """Stamps the end of every training batch and measures model-state memory at the last step."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.stamps: list[float] = []
        self.memory: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.stamps.append(time.perf_counter())

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.total_steps - 1:  # backward (and its reduction) just finished
            self.memory["grads"] = storage_bytes(grad_tensors(trainer.strategy, module))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # still inside fit: teardown would drop the engine and its buffer pool
        self.memory["params"] = storage_bytes(module.parameters())
        self.memory["optimizer"] = storage_bytes(optimizer_state_tensors(trainer.strategy))
        engine = getattr(trainer.strategy, "_engine", None)
        self.memory["pool"] = engine.pool.nbytes() if engine is not None else 0

    def steps_per_second(self, warmup: int) -> float:
        """Over the steps after ``warmup``: from the end of the last warm-up step to the end of the last step."""
        return (len(self.stamps) - warmup) / (self.stamps[-1] - self.stamps[warmup - 1])


# --- one worker ---------------------------------------------------------------------------------------------------


def make_strategy(name: str, bucket_cap_mb: float) -> Strategy:
    match name:
        case "ddp":
            return DDPStrategy(bucket_cap_mb=bucket_cap_mb)
        case "zero1":
            return Zero1Strategy(bucket_cap_mb=bucket_cap_mb)
        case "zero2":
            return Zero2Strategy(bucket_cap_mb=bucket_cap_mb)
    raise ValueError(f"unknown strategy {name!r}; HINT: pick one of {STRATEGIES}")


def fit(name: str, args: argparse.Namespace, callbacks: list[Callback]) -> ResidualMLP:
    total = args.warmup + args.steps
    pl.seed_everything(0, verbose=False)
    module = ResidualMLP(args.hidden, args.layers, args.batch_size, total)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=make_strategy(name, args.bucket_cap_mb),
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


def run_once(name: str, round_index: int, args: argparse.Namespace) -> dict[str, Any]:
    probe = Probe(args.warmup + args.steps)
    module = fit(name, args, [probe])
    return dict(
        strategy=name,
        round=round_index,
        steps_per_s=probe.steps_per_second(args.warmup),
        num_params=sum(p.numel() for p in module.parameters()),
        **probe.memory,
    )


class Profile(Callback):
    """Profiles the timed steps of one run and prints the ops that took the most time on rank 0."""

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
        return self.profiler.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)


def worker(args: argparse.Namespace) -> None:
    args.world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment
    results = []
    for round_index in range(args.rounds):
        shift = round_index % len(STRATEGIES)
        for name in STRATEGIES[shift:] + STRATEGIES[:shift]:
            results.append(run_once(name, round_index, args))
    everyone: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        print(report(everyone, args), flush=True)
    if args.profile:
        for name in STRATEGIES:
            profile = Profile(args.warmup, args.steps)
            fit(name, args, [profile])
            if dist.get_rank() == 0:
                print(f"\n### profile of {name}, rank 0, {args.steps} steps\n\n{profile.table()}", flush=True)


# --- the report ---------------------------------------------------------------------------------------------------


def report(everyone: list[list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """A markdown table: steps/s is the median over rounds of the slowest rank; its ratio to DDP is the median of
    the same-round ratios (pairing cancels noise that drifts between rounds); memory is the largest rank's."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rank_results in everyone:
        for result in rank_results:
            runs.setdefault((result["strategy"], result["round"]), []).append(result)
    speed = {key: min(r["steps_per_s"] for r in ranks) for key, ranks in runs.items()}
    rounds = range(args.rounds)
    lines = [
        "| strategy | steps/s (median) | steps/s (min-max) | ratio to ddp | params MiB/rank | grads MiB/rank"
        " | optimizer state MiB/rank | ZeRO comm pool MiB/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in STRATEGIES:
        speeds = [speed[name, r] for r in rounds]
        ratio = statistics.median(speed[name, r] / speed["ddp", r] for r in rounds)
        last = runs[name, args.rounds - 1]
        mem = {k: max(r[k] for r in last) / MIB for k in ("params", "grads", "optimizer", "pool")}
        lines.append(
            f"| {name} | {statistics.median(speeds):.2f} | {min(speeds):.2f}-{max(speeds):.2f} | {ratio:.3f}"
            f" | {mem['params']:.1f} | {mem['grads']:.1f} | {mem['optimizer']:.1f} | {mem['pool']:.1f} |"
        )
    psi, n = everyone[0][0]["num_params"], len(everyone)
    lines += ["", f"Model: residual MLP, Psi = {psi:,} parameters (fp32, Adam); world size N = {n};"
              f" batch size {args.batch_size} per rank; {args.rounds} rounds of {args.warmup} warm-up"
              f" + {args.steps} timed steps; bucket cap {args.bucket_cap_mb:g} MiB.",
              f"Expected per rank: params 4 Psi = {4 * psi / MIB:.1f} MiB; grads 4 Psi = {4 * psi / MIB:.1f} MiB"
              f" (ddp, zero1) vs 4 Psi/N = {4 * psi / n / MIB:.1f} MiB (zero2); Adam state 8 Psi ="
              f" {8 * psi / MIB:.1f} MiB (ddp) vs 8 Psi/N = {8 * psi / n / MIB:.1f} MiB (zero1, zero2)."]
    return "\n".join(lines)


# --- the launcher -------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, argv: list[str]) -> int:
    """Start ``world_size`` workers as torchrun would; rank 0's stdout (the report) passes through, everything
    else goes to log files, shown if a worker fails."""
    port, procs = free_port(), []
    with tempfile.TemporaryDirectory() as logs:
        for rank in range(world_size):
            env = dict(
                os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
            )
            log = open(Path(logs) / f"rank{rank}.log", "w")  # noqa: SIM115  (closed when the worker ends)
            stdout = None if rank == 0 else log
            procs.append((subprocess.Popen([sys.executable, __file__, *argv], env=env, stdout=stdout, stderr=log), log))
        codes = [proc.wait() for proc, _ in procs]
        for rank, ((_, log), code) in enumerate(zip(procs, codes, strict=True)):
            log.close()
            if code != 0:
                print(f"--- rank {rank} exited with {code} ---\n{Path(log.name).read_text()[-6000:]}", file=sys.stderr)
    return max(codes)


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(launch(args.world_size, sys.argv[1:]))
    worker(args)


if __name__ == "__main__":
    main()
