"""Time and memory of saving a "zero2" checkpoint directory and of consolidating it into one file.

Run with the package installed (``pip install -e .``): ``python benchmarks/bench_checkpoint.py [--params-millions N]``.

With no ``RANK`` in the environment the script starts ``--world-size`` copies of itself the way torchrun does (so every
``Trainer(devices=N)`` joins one gloo group and Lightning never relaunches itself). They train a stack of square
``nn.Linear`` layers for one Adam step under "zero2", so optimizer state exists, and save with
``trainer.save_checkpoint``. Then the launcher runs ``python -m lightning_zero consolidate`` twice (full, and
``--weights-only``), each in a fresh process reaped with ``os.wait4``, so each peak RSS is that process's own and not
the largest of every child so far (which ``RUSAGE_CHILDREN`` would give). A process that only imports
``lightning_zero`` is measured too: its peak RSS and seconds are the floor every consolidation stands on.

The checksums' cost: each worker then saves again and loads the checkpoint back (its files evicted from the page cache
first, as a resume in a new job finds them), alternately with the checksum functions and with no-ops in their place,
five rounds, and times the checksum work alone on the files just written; the table gives each rank's medians.

Everything is written under a temporary directory in /tmp, removed at the end.
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
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest.mock import patch

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  registers the strategy name "zero2"
from lightning_zero._checkpoint import checksums as _checksums
from lightning_zero._checkpoint.checksums import CHECKSUM_FILE, Record, share, sum_file
from lightning_zero._checkpoint.directory import DCP_METADATA, META_FILE, read_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # as a script too: the repository's packages
from benchmarks import _charts
from tests.launch import launch as launch_ranks

GIB = 2**30
ROUNDS = 5  # of the saves and loads that time the checksums


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=300.0, help="model size, in millions of parameters")
    parser.add_argument("--width", type=int, default=4096, help="width of the square linear layers")
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (torchrun's count wins)")
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)  # set by the launcher for its workers
    _charts.add_chart_argument(parser, "checkpoint")
    args = parser.parse_args(argv)
    if args.params_millions <= 0 or args.width < 1 or args.world_size < 1:
        parser.error("--params-millions, --width and --world-size must be positive")
    return args


# --- the model ----------------------------------------------------------------------------------------------------


class LinearStack(pl.LightningModule):
    """``layers`` square linear layers trained with Adam on one random sample per rank."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        # one sample per rank: the step only has to create optimizer state, so keep the activations tiny
        x = torch.randn(self.trainer.world_size, self.width, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=1)


def layer_count(args: argparse.Namespace) -> int:
    return max(1, round(args.params_millions * 1e6 / (args.width * args.width + args.width)))


# --- one worker ---------------------------------------------------------------------------------------------------


def train_one_step(args: argparse.Namespace) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    module = LinearStack(args.width, layer_count(args))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy="zero2",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module)
    return trainer


def reset_peak_rss() -> bool:
    """Make this process's peak RSS (``VmHWM``) restart from its current RSS; Linux only."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field such as ``VmRSS`` or ``VmHWM`` (peak RSS, which ``reset_peak_rss``
    resets; ``ru_maxrss`` may not follow the reset), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)


def checksum_seconds(checkpoint: Path, rank: int, world_size: int) -> tuple[float, float]:
    """Seconds of the checksum work alone, with the functions a save and a load call, on the files just written:
    summing the files this rank wrote (its shard file; for rank 0 ``.metadata`` and ``lightning_zero.pt`` too), and
    checking its share of the shard files."""
    record = Record.parse(checkpoint, (checkpoint / CHECKSUM_FILE).read_bytes())
    written = [name for name in record.files if name.startswith(f"__{rank}_")]
    if rank == 0:
        written += [DCP_METADATA, META_FILE]
    start = time.perf_counter()
    for name in written:
        sum_file(checkpoint / name)
    saving = time.perf_counter() - start
    shards = {name: s for name, s in record.files.items() if name not in (DCP_METADATA, META_FILE)}
    start = time.perf_counter()
    record.check_files(checkpoint, share(shards, rank, world_size))
    return saving, time.perf_counter() - start


def evict(checkpoint: Path) -> None:
    """Drop the checkpoint's files from the page cache (they are synced, so clean), as a resume in a new job finds
    them."""
    for file in checkpoint.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(action: Callable[[], object], cold: Path | None = None) -> float:
    """Seconds of ``action`` on every rank, from a common start to a common end; ``cold``: a checkpoint evicted from
    the page cache first."""
    if cold is not None and dist.get_rank() == 0:
        evict(cold)
    dist.barrier()  # every rank starts together, so each clock times the slowest rank too
    start = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - start


def without_checksums() -> ExitStack:
    """Saves that sum nothing and loads that check nothing, to time what the checksums add."""
    stack = ExitStack()
    stack.enter_context(patch.object(_checksums, "sum_file", lambda path: _checksums.FileSum(0, 0)))
    stack.enter_context(patch.object(_checksums.Record, "check_files", lambda self, path, names: None))
    return stack


def worker(args: argparse.Namespace) -> None:
    args.world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it from the environment
    rank = int(os.environ["RANK"])
    trainer = train_one_step(args)
    checkpoint = args.workdir / "checkpoint"
    dist.barrier()  # every rank starts the save together, so rank 0's clock times the slowest writer too
    reset = reset_peak_rss()
    before = status_bytes("VmRSS") if reset else None
    start = time.perf_counter()
    trainer.save_checkpoint(checkpoint)  # ends with a collective
    seconds = time.perf_counter() - start
    if rank == 0:
        print(f"rank 0: trainer.save_checkpoint took {seconds:.2f} s", flush=True)
    # without the reset, VmHWM would be the whole run's peak, training included; then it is left out
    result = {"seconds": seconds, "rss_before": before, "peak_rss": status_bytes("VmHWM") if reset else None}
    # Saves (to another path) and loads (back into the live shards, from a cold page cache) with and without
    # checksums, alternating so that neither always follows the other; medians of ROUNDS.
    timings: dict[str, list[float]] = {key: [] for key in ("save", "save_unchecked", "load", "load_unchecked")}
    again = args.workdir / "again"
    for _ in range(ROUNDS):
        for unchecked in (False, True):
            suffix = "_unchecked" if unchecked else ""
            with without_checksums() if unchecked else nullcontext():
                timings["save" + suffix].append(timed(partial(trainer.save_checkpoint, again)))
                load = partial(trainer.strategy.load_checkpoint, checkpoint)
                timings["load" + suffix].append(timed(load, cold=checkpoint))
    if rank == 0:
        shutil.rmtree(again)
    result.update({f"{key}_seconds": statistics.median(values) for key, values in timings.items()})
    dist.barrier()
    result["sum_seconds"], result["check_seconds"] = checksum_seconds(checkpoint, rank, args.world_size)
    (args.workdir / f"save_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # every rank done before gloo is torn down
    dist.destroy_process_group()


# --- processes ----------------------------------------------------------------------------------------------------


def launch_workers(args: argparse.Namespace, workdir: Path) -> None:
    """Start the workers as torchrun would, with the test suite's launcher (every rank stopped on the first failure,
    each one's output shown then); pass rank 0's output on."""
    argv = [*sys.argv[1:], "--workdir", str(workdir)]
    outputs = launch_ranks("benchmarks.bench_checkpoint", argv, args.world_size, timeout=24 * 3600)
    print(outputs[0], end="", flush=True)


@dataclass
class Measurement:
    what: str
    seconds: float
    peak_rss: int | None  # bytes
    output_bytes: int | None = None  # size of the file it wrote, read before the file is removed


def measure(what: str, command: list[str], output: Path | None = None) -> Measurement:
    """Run ``command`` in a fresh process; its wall time and its own peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's usage alone
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{what}: {command} exited with {proc.returncode}")
    size = output.stat().st_size if output is not None else None
    return Measurement(what, seconds, usage.ru_maxrss * 1024, size)


# --- the report ---------------------------------------------------------------------------------------------------


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def largest_tensor_bytes(checkpoint: Path) -> int:
    entries = read_meta(checkpoint)[1].state_dict_metadata.values()
    return max(e.size.numel() * e.properties.dtype.itemsize for e in entries if isinstance(e, TensorStorageMetadata))


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def table(rows: list[Measurement], checkpoint: Path) -> list[str]:
    ckpt, largest = gib(directory_bytes(checkpoint)), gib(largest_tensor_bytes(checkpoint))
    lines = [
        "| what | seconds | peak RSS GiB | checkpoint GiB | output GiB | largest tensor GiB |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.what} | {row.seconds:.2f} | {gib(row.peak_rss)} | {ckpt} | {gib(row.output_bytes)} | {largest} |"
        )
    return lines


def over_baseline(rows: list[Measurement], baseline: Measurement, checkpoint: Path) -> list[str]:
    """Each consolidation's peak RSS above the import floor, against what it had to hold."""
    largest = largest_tensor_bytes(checkpoint)
    lines = []
    for row in rows:
        assert row.output_bytes is not None and row.peak_rss is not None and baseline.peak_rss is not None
        extra, written = row.peak_rss - baseline.peak_rss, row.output_bytes
        lines.append(
            f"- {row.what}: peak RSS - import floor = {gib(extra)} GiB; output + largest tensor ="
            f" {gib(written + largest)} GiB (ratio {extra / (written + largest):.2f})"
        )
    return lines


def save_lines(results: list[dict[str, float | None]]) -> list[str]:
    lines = ["Save rows: the process's peak RSS during the save (VmHWM reset just before it), over its RSS then:"]
    for rank, result in enumerate(results):
        before, peak = result["rss_before"], result["peak_rss"]
        grown = "-" if before is None or peak is None else gib(int(peak - before))
        lines.append(f"- rank {rank}: RSS before save {gib(before)} GiB, peak during save +{grown} GiB")
    return lines


def checksum_lines(results: list[dict[str, float | None]]) -> list[str]:
    """What the checksums add to each rank's save and load: medians of the same save or load with and without the
    checksum functions (replaced by no-ops), and the checksum work timed alone."""
    lines = [
        f"Checksum cost (medians of {ROUNDS} alternating rounds; loads from a cold page cache; `alone`: the same"
        " functions run by themselves on files in the page cache):",
        "",
        "| rank | save s | save, no sums s | sums alone s | added to save | load s | load, no checks s | checks"
        " alone s | added to load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, r in enumerate(results):
        save, bare_save, sums = (float(r[k]) for k in ("save_seconds", "save_unchecked_seconds", "sum_seconds"))
        load, bare_load, checks = (float(r[k]) for k in ("load_seconds", "load_unchecked_seconds", "check_seconds"))
        lines.append(
            f"| {rank} | {save:.2f} | {bare_save:.2f} | {sums:.2f} | {(save - bare_save) / bare_save:+.1%} | {load:.2f}"
            f" | {bare_load:.2f} | {checks:.2f} | {(load - bare_load) / bare_load:+.1%} |"
        )
    return lines


def chart(rows: list[Measurement], results: list[dict[str, float | None]], args: argparse.Namespace) -> None:
    """Each process's seconds and peak RSS (the table), and each rank's save and load with and without checksums."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, (processes, checks) = plt.subplots(1, 2, figsize=(10, 4))
    names = [row.what.split(":")[0] for row in rows][::-1]
    for y, row in enumerate(rows[::-1]):
        first = y == 0
        processes.barh(y + 0.2, row.seconds, 0.4, color="#1f77b4", edgecolor="black", label="s" if first else None)
        processes.barh(y - 0.2, (row.peak_rss or 0) / GIB, 0.4, color="#ff7f0e", edgecolor="black",
                       label="peak RSS, GiB" if first else None)  # fmt: skip
    processes.set_yticks(range(len(names)), names, fontsize=8)
    processes.legend(fontsize=8)
    pairs = {"save": ("save_seconds", "save_unchecked_seconds"), "load": ("load_seconds", "load_unchecked_seconds")}
    labels: list[str] = []
    for rank, result in enumerate(results):
        for what, (checked, bare) in pairs.items():
            x = len(labels)
            checks.bar(x - 0.2, float(result[bare]), 0.4, color="#7f7f7f", edgecolor="black",
                       label="without checksums" if x == 0 else None)  # fmt: skip
            checks.bar(x + 0.2, float(result[checked]), 0.4, color="#2ca02c", edgecolor="black",
                       label="with checksums" if x == 0 else None)  # fmt: skip
            labels.append(f"{what}\nrank {rank}")
    checks.set_xticks(range(len(labels)), labels, fontsize=8)
    highest = max(float(r[k]) for r in results for keys in pairs.values() for k in keys)
    checks.set(ylabel="seconds (median of rounds)", ylim=(0, highest * 1.3))
    checks.legend(fontsize=8)
    for axes in (processes, checks):
        axes.grid(alpha=0.3)
    psi = layer_count(args) * (args.width * args.width + args.width)
    figure.suptitle(f"A zero2 checkpoint of {psi / 1e6:.0f} M parameters with Adam: save, consolidate, checksums")
    _charts.save(figure, args.chart, f"{_charts.cpu()} ({args.world_size} CPU ranks)")


def file_sizes(checkpoint: Path) -> list[str]:
    """Every file of the checkpoint directory; DCP names rank r's shard file ``__r_0.distcp``."""
    lines = ["| file | GiB | bytes |", "|---|---|---|"]
    for file in sorted(checkpoint.iterdir()):
        lines.append(f"| {file.name} | {gib(file.stat().st_size)} | {file.stat().st_size:,} |")
    return lines


def setup_line(args: argparse.Namespace) -> str:
    layers = layer_count(args)
    psi = layers * (args.width * args.width + args.width)
    return (
        f"Model: {layers} x nn.Linear({args.width}, {args.width}), Psi = {psi:,} fp32 parameters ({4 * psi / GIB:.2f}"
        f" GiB), Adam (state 8 Psi = {8 * psi / GIB:.2f} GiB); strategy zero2 on {args.world_size} CPU processes."
    )


# --- the launcher -------------------------------------------------------------------------------------------------


def consolidate(what: str, checkpoint: Path, output: Path, *flags: str) -> Measurement:
    command = [sys.executable, "-m", "lightning_zero", "consolidate", str(checkpoint), str(output), *flags]
    return measure(what, command, output)


def run(args: argparse.Namespace, workdir: Path) -> list[str]:
    launch_workers(args, workdir)
    checkpoint = workdir / "checkpoint"
    results = [json.loads((workdir / f"save_rank{rank}.json").read_text()) for rank in range(args.world_size)]
    saves = [Measurement(f"save, rank {r}", res["seconds"], res["peak_rss"]) for r, res in enumerate(results)]
    baseline = measure("floor: `python -c 'import lightning_zero'`", [sys.executable, "-c", "import lightning_zero"])
    full = consolidate("consolidate (full)", checkpoint, workdir / "full.ckpt")
    (workdir / "full.ckpt").unlink()  # measured; free the disk before the next one
    weights = consolidate("consolidate --weights-only", checkpoint, workdir / "weights.ckpt", "--weights-only")
    (workdir / "weights.ckpt").unlink()
    chart([*saves, baseline, full, weights], results, args)
    return [
        setup_line(args),
        "",
        *table([*saves, baseline, full, weights], checkpoint),
        "",
        *over_baseline([full, weights], baseline, checkpoint),
        "",
        *save_lines(results),
        "",
        *checksum_lines(results),
        "",
        *file_sizes(checkpoint),
    ]


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_", dir="/tmp") as tmp:
        print("\n".join(run(args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
