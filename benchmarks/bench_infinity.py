"""ZeRO-Infinity on the CPU: host memory per parameter and seconds per step of ``"ddp"``, ``"zero3"``,
``"zero3_offload"`` and ``"zero3_infinity"``, then a model whose states are larger than the machine's memory.

Run from the repository root: ``python -m benchmarks.bench_infinity [--model mlp --width 8192 --layers 4 --steps 3]
[--ways ddp,zero3,zero3_offload,zero3_infinity] [--offload-dir DIR] [--capacity-layers 26] [--memory-limit GIB]``.

``--model mlp``: a residual MLP of ``--layers`` blocks ``x + relu(Linear(width, width)(x))`` (width 8192 by default)
trained on random rows, 4 a rank a step; ``--model transformer``: Lightning's demo Transformer
(``lightning.pytorch.demos.transformer.Transformer``: vocabulary 8000, ``--width`` 2048 by default, 16 heads, a
feed-forward 4 times the width, ``--layers`` encoder and as many decoder layers) trained on random tokens, 2 rows of 16
a rank a step. Either is built in ``configure_model`` (stage 3 builds it without memory and gives each unit its values
shard by shard; ``"ddp"`` builds it whole on every rank) and trained with ``torch.optim.Adam`` by 2 CPU processes,
each way in a launch of its own so that each peak is its own. ``"zero3_infinity"`` is ``Zero3Strategy.
from_deepspeed_config`` with ``offload_param`` and ``offload_optimizer`` on ``"nvme"``: parameter shards, gradients
and Adam state in memory-mapped files under a fresh directory below ``--offload-dir`` (the system's temporary
directory by default), removed afterwards.

``--memory-limit GIB`` runs each way twice, side by side: inside a memory group of its own without a limit, then
inside one limited to that many GiB, page cache included (cgroup v2 where its memory controller is mounted, v1
otherwise; see ``tests/memory_group.py``), as a cluster's job limit would; "x unlimited" is then the price of the
limit in seconds per step (``--limited-only`` skips the unlimited runs; ``--rounds N`` runs them all N times,
interleaved, and adds each way's medians). It needs root, and without it the runs are
unlimited and say so. ``--page-cache auto,drop`` runs ``"zero3_infinity"`` once with each ``page_cache`` option
(``"auto"`` by default); ``--unit-params N`` gives it ``auto_wrap_policy=N`` (a unit of each submodule holding N
parameters or more outside smaller units) and ``--prefetch-units`` its ``prefetch_units``. Words of the tables:

- **model states**: fp32 parameters, gradients and Adam's two moments, 16 bytes a parameter, the whole model's;
- **baseline**: a rank's resident memory after its imports, before the model exists (Python, torch, Lightning);
- **peak RSS**: a rank's largest resident memory (``ru_maxrss``): file pages count while the process maps them;
- **anonymous peak**: a rank's largest anonymous memory (``RssAnon``, sampled every 2 ms on a thread): what it holds
  that no file backs;
- **group peak**: in a memory group, its largest usage, both ranks' anonymous memory and the page cache they read or
  dirtied (at the limit: the kernel reclaimed there, or killed);
- **page cache at step end**: in a memory group, what it holds besides anonymous memory at the end of each step after
  the first (median): the offload files' pages the budget keeps;
- **disk reads per step**: what both ranks read from the disk in a step after the first (median; ``read_bytes`` of
  ``/proc/self/io``): the offload files' pages read again because they had left the page cache;
- **host bytes per parameter**: the ranks' peaks less their baselines, summed, over the model's parameters;
- **largest model (derived)**: the parameters whose bytes at that rate fill the machine's memory, less 2 GiB of
  headroom and the baselines: a line drawn through one point, not a measurement.

``--capacity-layers N`` then trains ``"zero3_infinity"`` alone at N layers (26 at width 8192: 1.75 B parameters,
26 GiB of model states). Without a memory limit, a way other than ``"zero3_infinity"`` whose model states (under
``"ddp"`` one whole copy a rank) would not fit the machine's memory is skipped; within one every way runs, to show
which the limit kills.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.transformer import Transformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import _charts
from benchmarks._ranks import run_ranks, save_rank_results
from lightning_zero import Zero3Strategy
from tests import memory_group

GIB = 2**30
STATE_BYTES = 16  # fp32 parameter, gradient and two Adam moments
HEADROOM = 2 * GIB  # of the machine's memory, left to the system in the derived largest model
ROWS = 4  # a rank's batch of the MLP
TOKENS = (2, 16)  # a rank's batch of the Transformer: rows, tokens a row
VOCAB = 8000
WIDTHS = {"mlp": 8192, "transformer": 2048}  # --width by default
RANKS = 2
WAYS = ("ddp", "zero3", "zero3_offload", "zero3_infinity")
HATCHES = {"offload": "//", "infinity": "xx"}  # in the charts, beside each stage's colour
TIMEOUT = 4 * 3600  # seconds a launch may run: the capacity run moves tens of GB a step through the page cache


# --- in a rank -------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """``x + relu(linear(x))``: one stage-3 unit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class ResidualMLP(pl.LightningModule):
    """``layers`` blocks of ``width``, trained to shrink their output on random rows."""

    def __init__(self, width: int, layers: int, steps: int) -> None:
        super().__init__()
        self.width, self.layers, self.steps = width, layers, steps

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            self.blocks = nn.ModuleList(Block(self.width) for _ in range(self.layers))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        rows = torch.randn(ROWS * self.steps * self.trainer.world_size, self.width)  # seeded in `worker`
        return DataLoader(TensorDataset(rows), batch_size=ROWS)


def demo_transformer(width: int, layers: int) -> Transformer:
    return Transformer(vocab_size=VOCAB, ninp=width, nhead=16, nhid=4 * width, nlayers=layers)


class DemoTransformer(pl.LightningModule):
    """Lightning's demo Transformer, ``layers`` encoder and decoder layers of ``width``, on random tokens."""

    def __init__(self, width: int, layers: int, steps: int) -> None:
        super().__init__()
        self.width, self.layers, self.steps = width, layers, steps

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = demo_transformer(self.width, self.layers)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        output = self.model(tokens[:, :-1], tokens[:, 1:])
        return nn.functional.nll_loss(output, tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        rows, tokens = TOKENS
        data = torch.randint(0, VOCAB, (rows * self.steps * self.trainer.world_size, tokens + 1))
        return DataLoader(TensorDataset(data), batch_size=rows)


MODELS: dict[str, type[pl.LightningModule]] = {"mlp": ResidualMLP, "transformer": DemoTransformer}


class Record(pl.Callback):
    """A rank's peak before training (the model built and sharded), its seconds per training step, and at the end of
    training its parameter count and the offload files."""

    def __init__(self, files_dir: Path | None) -> None:
        self.files_dir = files_dir
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.disk_reads: list[int] = []  # bytes this rank read from the disk, step by step
        self.page_cache: list[int] = []  # bytes its memory group held besides anonymous memory, at each step's end
        self.traffic: list[tuple[int, float]] = []  # the budget's bytes written back and seconds waited, at each end
        self.measured: dict[str, int] = {}
        self._started = 0.0
        self._read = 0

    def on_train_start(self, *_: Any) -> None:
        self.measured["peak_before_training"] = peak_rss_bytes()

    def on_train_batch_start(self, *_: Any) -> None:
        self._read = disk_read_bytes()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)
        self.losses.append(float(outputs["loss"]))
        self.disk_reads.append(disk_read_bytes() - self._read)
        placement = getattr(trainer.strategy, "placement", None)  # ddp has none
        traffic = getattr(getattr(placement, "writeback", None), "traffic", None)
        if traffic is not None:  # what the page-cache budget wrote back and waited for, so far
            self.traffic.append((traffic.written_back, traffic.waited))
        usage = memory_group.own_usage()
        if usage is not None:
            self.page_cache.append(usage.page_cache)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.measured["params"] = sum(p.numel() for p in module.parameters())  # a DTensor's numel is the whole's
        self.measured["machine_page_cache"] = meminfo("Cached")
        if self.files_dir is not None:  # while the files live: they have no names and go with the process
            self.measured["mapped_files"] = mapped_bytes(self.files_dir)
            self.measured["fs_used"] = filesystem_used(self.files_dir)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line.")


def disk_read_bytes() -> int:
    """Bytes this process has had read from the disk (page-cache misses, read-ahead included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line.")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key} line.")


def filesystem_used(directory: Path) -> int:
    """Bytes in use on ``directory``'s filesystem, by every process."""
    fs = os.statvfs(directory)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


def mapped_bytes(directory: Path) -> int:
    """Bytes of this process's mappings of files under ``directory`` (nameless ones show as ``#inode (deleted)``)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{directory}/"):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            total += end - start
    return total


def strategy(way: str, files_dir: Path | None, args: argparse.Namespace) -> str | Zero3Strategy:
    if way == "zero3_infinity":
        nvme = {"device": "nvme", "nvme_path": str(files_dir)}
        options: dict[str, Any] = {"page_cache": int(args.page_cache) if args.page_cache.isdigit() else args.page_cache}
        if args.unit_params is not None:
            options["auto_wrap_policy"] = args.unit_params
        if args.prefetch_units is not None:
            options["prefetch_units"] = args.prefetch_units
        return Zero3Strategy.from_deepspeed_config(
            {"zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}, **options
        )
    return way


def worker(args: argparse.Namespace) -> None:
    baseline = rss_bytes()  # after the imports, before the model
    anonymous = memory_group.AnonymousPeak()
    fs_before = filesystem_used(args.files_dir) if args.files_dir is not None else 0
    pl.seed_everything(0, verbose=False)
    record = Record(args.files_dir)
    way = strategy(args.way, args.files_dir, args)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=way, max_steps=args.steps,
        callbacks=[record], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(MODELS[args.model](args.width, args.layers, args.steps))
    results = {"baseline": baseline, "peak_rss": peak_rss_bytes(), "seconds": record.seconds, "losses": record.losses,
               "disk_reads": record.disk_reads, "page_cache": record.page_cache, "traffic": record.traffic}  # fmt: skip
    results.update(record.measured)
    results["peak_anonymous"] = anonymous.stop()
    if args.files_dir is not None:
        results["fs_grew"] = results.pop("fs_used") - fs_before
    save_rank_results(args.out_dir, int(os.environ["RANK"]), results)


# --- the launching process -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One way's launch: what each rank recorded."""

    way: str
    ranks: list[dict[str, Any]]
    page_cache: str  # the option, for zero3_infinity
    limit: float | None = None  # GiB: the memory group's limit
    group: memory_group.GroupResult | None = None  # in a memory group: its peak and its OOM kills
    round: int = 0  # under --rounds, which round it ran in

    @property
    def params(self) -> int:
        return self.ranks[0]["params"]

    @property
    def per_param(self) -> float:
        """Host bytes per parameter at the peak: the ranks' peaks less their baselines, over the parameters."""
        return sum(r["peak_rss"] - r["baseline"] for r in self.ranks) / self.params

    @property
    def step_seconds(self) -> float:
        """Median over the steps after the first (which creates Adam's state), of rank 0."""
        return statistics.median(self.ranks[0]["seconds"][1:])

    @property
    def disk_reads(self) -> float:
        """Bytes both ranks read from the disk in a step, median over the steps after the first."""
        return statistics.median(sum(step) for step in zip(*(r["disk_reads"][1:] for r in self.ranks), strict=True))

    @property
    def page_cache_held(self) -> float | None:
        """Bytes the memory group held besides anonymous memory at a step's end, median after the first step."""
        held = self.ranks[0]["page_cache"][1:]
        return statistics.median(held) if held else None

    @property
    def budget_traffic(self) -> tuple[float, float] | None:
        """Bytes the page-cache budget wrote back and seconds it waited for them in a step of rank 0, median after the
        first step; ``None`` without offload files."""
        ends = self.ranks[0]["traffic"]
        if len(ends) < 2:
            return None
        steps = list(itertools.pairwise(ends))
        return (
            statistics.median(b[0] - a[0] for a, b in steps),
            statistics.median(b[1] - a[1] for a, b in steps),
        )

    @property
    def label(self) -> str:
        return f"{self.way}, {self.page_cache}" if self.way == "zero3_infinity" else self.way

    def largest(self, mem_total: int) -> float:
        """Parameters (derived) whose bytes at :attr:`per_param` fill ``mem_total`` less headroom and baselines."""
        return (mem_total - HEADROOM - sum(r["baseline"] for r in self.ranks)) / self.per_param


def sig(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, in plain notation: ``"0.000124"``, ``"9.10"``, ``"1234"``."""
    if value == 0:
        return "0"
    return f"{value:.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


def parameter_count(model: str, width: int, layers: int) -> int:
    if model == "transformer":
        with torch.device("meta"):
            return sum(p.numel() for p in demo_transformer(width, layers).parameters())
    return layers * (width * width + width)


def state_bytes_held(way: str, params: int) -> int:
    """The machine's bytes of model states under ``way``: ``"ddp"`` holds them whole on every rank."""
    return STATE_BYTES * params * (RANKS if way == "ddp" else 1)


def launch(way: str, args: argparse.Namespace, layers: int, limit: float | None, page_cache: str) -> Run | str:
    """Train under ``way`` on :data:`RANKS` ranks, inside a memory group of its own limited to ``limit`` GiB (``None``:
    unlimited, still accounted) where groups can be made: the :class:`Run`, or a table row saying how it failed."""
    name = f"{way}, {page_cache}" if way == "zero3_infinity" else way
    where = "no limit" if limit is None else f"{sig(limit)} GiB"
    if args.no_groups:
        done = launch_ranks(way, args, layers, page_cache)
        return Run(done.way, done.ranks, page_cache) if isinstance(done, Run) else done
    with memory_group.joined(None if limit is None else int(limit * GIB)) as group:
        done = launch_ranks(way, args, layers, page_cache)
    if isinstance(done, Run):
        return Run(done.way, done.ranks, page_cache, limit, group)
    if group.oom_kills:
        peak = sig(group.peak / GIB)
        return f"| {name} | {where} | killed by the OOM killer ({group.oom_kills} kills; group peak {peak} GiB) |"
    return done.replace(f"| {way} |", f"| {name} | {where} |", 1)


def launch_ranks(way: str, args: argparse.Namespace, layers: int, page_cache: str) -> Run | str:
    argv = ["--model", args.model, "--width", str(args.width), "--layers", str(layers), "--steps", str(args.steps),
            "--way", way, "--page-cache", page_cache]  # fmt: skip
    argv += ["--unit-params", str(args.unit_params)] if args.unit_params is not None else []
    argv += ["--prefetch-units", str(args.prefetch_units)] if args.prefetch_units is not None else []
    try:
        if way != "zero3_infinity":
            return Run(way, run_ranks("benchmarks.bench_infinity", argv, RANKS, timeout=TIMEOUT), page_cache)
        with tempfile.TemporaryDirectory(dir=offload_base(args), prefix="bench_infinity-") as files_dir:
            ranks = run_ranks("benchmarks.bench_infinity", [*argv, "--files-dir", files_dir], RANKS, timeout=TIMEOUT)
            return Run(way, ranks, page_cache)
    except (RuntimeError, TimeoutError) as error:  # the launcher's LaunchError is a RuntimeError
        lines = str(error).splitlines()
        cause = next((line for line in reversed(lines) if "Error" in line), lines[0])
        return f"| {way} | failed: {cause.strip()[:200]} |"


def offload_base(args: argparse.Namespace) -> Path:
    """The directory zero3_infinity's own directory is made in."""
    return args.offload_dir or Path(tempfile.gettempdir())


def table(runs: list[Run | str], mem_total: int) -> list[str]:
    """One row a run: a :class:`Run`, or a line saying why it was skipped; "x unlimited" divides its seconds per step
    by those of the same way's unlimited run."""
    lines = [
        "| way | memory limit | parameters (B) | model states (GiB, 16 B/param) | peak RSS per rank, rank 0 / 1 (GiB)"
        " | anonymous peak per rank (GiB) | group peak (GiB) | page cache at step end (GiB)"
        " | disk reads per step (GiB) | written back by the budget per step, rank 0 (GiB) | waited for it (s/step)"
        " | host bytes per parameter at peak | s/step | x unlimited"
        " | largest model on this machine (B params, derived) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    unlimited = {(r.label, r.round): r.step_seconds for r in runs if isinstance(r, Run) and r.limit is None}
    for run in runs:
        if isinstance(run, str):
            lines.append(run)
            continue
        peaks = " / ".join(f"{r['peak_rss'] / GIB:.2f}" for r in run.ranks)
        anonymous = " / ".join(f"{r['peak_anonymous'] / GIB:.2f}" for r in run.ranks)
        group = "-" if run.group is None else f"{run.group.peak / GIB:.2f}"
        held = "-" if run.page_cache_held is None else f"{run.page_cache_held / GIB:.2f}"
        traffic = "- | -"
        if run.budget_traffic is not None:
            traffic = f"{run.budget_traffic[0] / GIB:.2f} | {run.budget_traffic[1]:.2f}"
        price = "-"
        if run.limit is not None and (run.label, run.round) in unlimited:
            price = f"{run.step_seconds / unlimited[run.label, run.round]:.2f}"
        limit = "none" if run.limit is None else f"{sig(run.limit)} GiB"
        lines.append(
            f"| {run.label} | {limit} | {sig(run.params / 1e9, 4)} | {sig(STATE_BYTES * run.params / GIB)} | {peaks}"
            f" | {anonymous} | {group} | {held} | {run.disk_reads / GIB:.2f} | {traffic}"
            f" | {run.per_param:.2f} | {sig(run.step_seconds)} | {price} | {sig(run.largest(mem_total) / 1e9)} |"
        )
    return lines


def files_note(run: Run, directory: Path) -> str:
    """What the offload files held at the end of training, beside the page cache and the disk's room."""
    mapped = " / ".join(sig(r["mapped_files"] / GIB) for r in run.ranks)
    grew = " / ".join(sig(r["fs_grew"] / GIB) for r in run.ranks)
    fs = os.statvfs(directory)
    room = fs.f_bavail * fs.f_frsize
    return (
        f"{run.label}, {sig(run.params / 1e9, 4)} B parameters ({sig(STATE_BYTES * run.params / GIB)} GiB of model"
        f" states): at the end of training rank 0 / 1 mapped {mapped} GiB of files under the offload directory, whose"
        f" filesystem then used {grew} GiB more than as each rank started (both ranks' files); the machine's page"
        f" cache held {run.ranks[0]['machine_page_cache'] / GIB:.2f} GiB. The disk has {room / GIB:.0f} GiB free now:"
        f" files for {sig(room / STATE_BYTES / 1e9)} B parameters."
    )


def setup_peaks(runs: list[Run]) -> str:
    """Each way's peak RSS per rank before its first step (what building and sharding the model took), and rank 0's
    losses."""
    peaks = (" / ".join(sig(r["peak_before_training"] / GIB) for r in run.ranks) for run in runs)
    losses = (", ".join(sig(loss, 4) for loss in run.ranks[0]["losses"]) for run in runs)
    return "Peak RSS before the first step (model built and sharded), rank 0 / 1 (GiB): " + ", ".join(
        f"{run.label} {where(run)}: {peak}" for run, peak in zip(runs, peaks, strict=True)
    ) + "\nLosses of rank 0, step by step: " + "; ".join(
        f"{run.label} {where(run)}: {loss}" for run, loss in zip(runs, losses, strict=True)
    )


def rounds_note(runs: list[Run]) -> str:
    """Under --rounds: each way's median seconds per step over the rounds, with and without the limit, and their
    ratio."""
    lines = ["Median over the rounds, s/step (each round's steps after the first, rank 0):"]
    for label in dict.fromkeys(run.label for run in runs):
        by_limit = {}
        for limit in dict.fromkeys(run.limit for run in runs):
            seconds = [run.step_seconds for run in runs if run.label == label and run.limit == limit]
            if seconds:
                by_limit[limit] = statistics.median(seconds)
        parts = [f"{'no limit' if limit is None else f'{sig(limit)} GiB'} {sig(value)}" for limit, value in
                 by_limit.items()]  # fmt: skip
        ratio = ""
        if None in by_limit and len(by_limit) == 2:
            limited = next(value for limit, value in by_limit.items() if limit is not None)
            ratio = f"; x unlimited {limited / by_limit[None]:.2f}"
        lines.append(f"- {label}: {', '.join(parts)}{ratio}")
    return "\n".join(lines)


def where(run: Run) -> str:
    return "(no limit)" if run.limit is None else f"({sig(run.limit)} GiB)"


PAGE_CACHE_NOTE = (
    "Peak RSS counts file pages only while a process maps them; the page cache the kernel keeps of the offload files"
    " belongs to no process and is not counted: the kernel writes it back and evicts it when memory is wanted."
)


def chart(runs: list[Run], capacity: Run | None, mem_total: int, args: argparse.Namespace) -> None:
    """Host bytes per parameter and seconds per step of each way; the capacity run's peaks against the memory."""
    plt = _charts.pyplot()
    if plt is None or not runs:
        return
    panels = 3 if capacity is not None else 2
    figure, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8))
    names = [run.way for run in runs][::-1]
    for y, run in enumerate(runs[::-1]):
        hatch = HATCHES.get(run.way.rpartition("_")[2])
        for panel, value, text in ((axes[0], run.per_param, sig(run.per_param)),
                                   (axes[1], run.step_seconds, f"{sig(run.step_seconds)} s")):  # fmt: skip
            panel.barh(y, value, color=_charts.color(run.way), edgecolor="black", hatch=hatch)
            panel.text(value, y, f" {text}", va="center", fontsize=8)
    axes[0].set(xlabel="host bytes per parameter at peak", title=f"{sig(runs[0].params / 1e9)} B parameters")
    axes[1].set(xlabel="seconds per step (median after the first)")
    for panel in axes[:2]:
        panel.set_yticks(range(len(names)), names)
        panel.set_xlim(0, panel.get_xlim()[1] * 1.25)
    if capacity is not None:
        states = STATE_BYTES * capacity.params / GIB
        bottom = 0.0
        for rank, result in enumerate(capacity.ranks):
            peak = result["peak_rss"] / GIB
            axes[2].bar(0, peak, bottom=bottom, color=("#2ca02c", "#98df8a")[rank % 2], edgecolor="black",
                        label=f"peak RSS, rank {rank}")  # fmt: skip
            bottom += peak
        axes[2].bar(1, states, color="#d62728", edgecolor="black", label="model states (16 B/param)")
        axes[2].axhline(mem_total / GIB, color="black", linestyle="--", label=f"MemTotal {sig(mem_total / GIB)} GiB")
        axes[2].set_xticks([0, 1], ["zero3_infinity\n(both ranks)", "model states"])
        title = f"{sig(capacity.params / 1e9)} B parameters: {sig(capacity.step_seconds)} s/step"
        axes[2].set(ylabel="GiB", title=title, ylim=(0, 1.5 * max(states, mem_total / GIB)))
        axes[2].legend(fontsize=7, loc="upper left", ncols=2)
        axes[2].grid(axis="y", alpha=0.3)
    for panel in axes[:2]:
        panel.grid(axis="x", alpha=0.3)
    figure.suptitle(f"{model_name(args)}, Adam, {RANKS} CPU ranks: what stays in host memory")
    _charts.save(figure, args.chart, f"{_charts.cpu()} ({RANKS} CPU ranks)")


def model_name(args: argparse.Namespace) -> str:
    if args.model == "transformer":
        return f"Lightning's demo Transformer of width {args.width}"
    return f"Residual MLP of width {args.width}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--width", type=int, help="8192 for the MLP, 2048 for the Transformer by default")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of each run, 2 or more")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--offload-dir", type=Path, help="where zero3_infinity's directory is made (default: $TMPDIR)")
    parser.add_argument("--capacity-layers", type=int, help="then zero3_infinity alone at this many layers")
    parser.add_argument("--memory-limit", type=float, metavar="GIB", help="run each way inside a memory group")
    parser.add_argument("--limited-only", action="store_true", help="under --memory-limit, skip the unlimited runs")
    parser.add_argument("--rounds", type=int, default=1, help="run every launch this many times, interleaved")
    parser.add_argument("--page-cache", default="auto", help="zero3_infinity's page_cache options, comma-separated")
    parser.add_argument("--unit-params", type=int, help="zero3_infinity's auto_wrap_policy: units of this many params")
    parser.add_argument("--prefetch-units", type=int, help="zero3_infinity's prefetch_units (default 2)")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # inside a rank
    parser.add_argument("--files-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    _charts.add_chart_argument(parser, "infinity")
    args = parser.parse_args()
    args.width = args.width or WIDTHS[args.model]
    if args.way is not None:
        worker(args)
        return
    ways = args.ways.split(",")
    if unknown := sorted(set(ways) - set(WAYS)):
        parser.error(f"--ways {args.ways!r} names {unknown}; the ways are {', '.join(WAYS)}")
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: seconds per step are those after the first, so give 2 or more")
    mem_total = meminfo("MemTotal")
    print(f"{_charts.cpu()}; MemTotal {mem_total / GIB:.1f} GiB; {RANKS} CPU ranks, each way in its own launch")
    print(f"{model_name(args)}, {args.layers} layers, Adam, {args.steps} steps")
    reason = memory_group.unavailable_reason()
    args.no_groups = reason is not None  # without groups nothing is limited or accounted
    if args.memory_limit is not None and reason is not None:
        print(f"--memory-limit {args.memory_limit}: not applied ({reason}); the runs are unlimited")
        args.memory_limit = None
    elif args.memory_limit is not None:
        print(f"Each way inside a memory group without a limit, then in one limited to {args.memory_limit} GiB, page"
              " cache included" if not args.limited_only else f"Each way inside a memory group limited to"
              f" {args.memory_limit} GiB, page cache included")  # fmt: skip
    print()
    limits = [args.memory_limit] if args.limited_only or args.memory_limit is None else [None, args.memory_limit]
    runs: list[Run | str] = []
    for round_ in range(args.rounds):
        for way in ways:
            needs = state_bytes_held(way, parameter_count(args.model, args.width, args.layers))
            for page_cache in args.page_cache.split(",") if way == "zero3_infinity" else ["auto"]:
                for limit in limits:
                    if needs > mem_total and way != "zero3_infinity" and limit is None:
                        runs.append(f"| {way} | no limit | skipped: needs {needs / GIB:.1f} GiB |")
                        continue
                    done = launch(way, args, args.layers, limit, page_cache)
                    runs.append(dataclasses.replace(done, round=round_) if isinstance(done, Run) else done)
    print("\n".join(table(runs, mem_total)), flush=True)
    measured = [run for run in runs if isinstance(run, Run)]
    if args.rounds > 1:
        print(f"\n{rounds_note(measured)}")
    print(f"\n{setup_peaks(measured)}\n{PAGE_CACHE_NOTE}")
    for run in measured:
        if run.way == "zero3_infinity":
            print(files_note(run, offload_base(args)))
    capacity = None
    if args.capacity_layers:
        params = parameter_count(args.model, args.width, args.capacity_layers)
        print(f"\nCapacity: zero3_infinity alone, {args.capacity_layers} layers, {sig(params / 1e9, 4)} B parameters,"
              f" {sig(STATE_BYTES * params / GIB)} GiB of model states\n", flush=True)  # fmt: skip
        done = launch("zero3_infinity", args, args.capacity_layers, args.memory_limit, args.page_cache.split(",")[0])
        print("\n".join(table([done], mem_total)), flush=True)
        if isinstance(done, Run):
            print(f"{setup_peaks([done])}\n{files_note(done, offload_base(args))}")
            capacity = done
    chart(measured, capacity, mem_total, args)


if __name__ == "__main__":
    main()
