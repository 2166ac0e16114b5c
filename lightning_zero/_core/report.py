"""A model-state memory report for the start of ``fit``: what this rank holds, measured by walking tensors, beside
what the ZeRO paper's formulas expect (:mod:`lightning_zero.estimate`), and how it is logged."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning_utilities.core import rank_zero
from torch import nn
from torch.optim import Adam, AdamW, Optimizer
from tqdm.contrib.logging import logging_redirect_tqdm

from lightning_zero._core.optimizers import unwrap
from lightning_zero.estimate import MemoryEstimate, estimate, format_bytes
from lightning_zero.memory import BufferHolder, ModelStateBytes, communication_bytes, measure

_PRECISION_OF_ITEMSIZE = {2: "bf16-true", 4: "32-true", 8: "64-true"}  # the bytes are all the estimate needs


def format_report(
    measured: ModelStateBytes, expected: MemoryEstimate, *, title: str, communication: int | None = None
) -> str:
    """A markdown table of ``measured`` beside ``expected.per_rank`` by category, under ``title``, with a note for
    each category that is still empty because it is created later (gradients in backward, optimizer state at the
    first step). ``communication``: the bytes of the communication buffers held between steps; where there are
    any, a row of their own below the model state (the paper's formulas do not count them), and the total held."""
    planned = expected.per_rank
    rows = [
        ("parameters", measured.parameters, planned.parameters),
        ("gradients", measured.gradients, planned.gradients),
        ("master weights", measured.master_weights, planned.master_weights),
        ("optimizer state", measured.optimizer_state, planned.optimizer_state),
        ("total", measured.total, planned.total),
    ]
    lines = [title, "", "| model state per rank | measured | estimate |", "|---|---|---|"]
    lines += [f"| {name} | {format_bytes(got)} | {format_bytes(want)} |" for name, got, want in rows]
    if communication:
        lines.append(f"| communication buffers | {format_bytes(communication)} | not model state |")
        lines.append(f"| held in all | {format_bytes(measured.total + communication)} | |")
    notes = []
    if measured.gradients == 0 < planned.gradients:
        notes.append("Gradients are created in the first backward.")
    if measured.optimizer_state == 0 < planned.optimizer_state:
        notes.append("Optimizer state is created at the first step.")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def memory_report(
    module: nn.Module,
    optimizers: Iterable[Optimizer],
    *,
    strategy: str,
    num_ranks: int,
    num_nodes: int = 1,
    master_weights: bool = False,
    buffers: BufferHolder | None = None,
    offload: bool = False,
    shard_group_size: int | None = None,
) -> str:
    """This rank's model state (``lightning_zero.memory.measure``) beside the estimate for ``strategy`` (``"ddp"``,
    ``"zero1"``, ``"zero2"`` or ``"zero3"``), as :func:`format_report`'s table. The estimate takes the parameter
    count and dtype from ``module`` (a DTensor counts whole) and the optimizer's kind from ``optimizers``; with
    ``offload`` a note says what lives in host memory."""
    optimizers = list(optimizers)
    params = list(module.parameters())
    num_params = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    elements_by_itemsize: Counter[int] = Counter()
    for p in params:
        elements_by_itemsize[p.element_size()] += p.numel()
    # Master weights mean a 16-bit module, even where stage 3 keeps fp32 shards as the masters.
    precision = "bf16-true" if master_weights else _PRECISION_OF_ITEMSIZE[elements_by_itemsize.most_common(1)[0][0]]
    kind = optimizer_kind(optimizers)
    expected = estimate(
        num_params,
        num_ranks=num_ranks,
        num_nodes=num_nodes,
        precision=precision,
        master_weights=master_weights,
        optimizer=kind or "adam",
        trainable_params=trainable,
        shard_group_size=shard_group_size,
    )[strategy]
    assumed = "" if kind is not None else ", optimizer state estimated as Adam's"
    ranks = f"{num_ranks} rank{'s' if num_ranks > 1 else ''}"
    groups = "" if shard_group_size in (None, num_ranks) else f" in shard groups of {shard_group_size}"
    title = f"Model state per rank of {num_params:,} parameters under `{strategy}` on {ranks}{groups}{assumed}:"
    held = measure(module, optimizers, buffers)
    report = format_report(held, expected, title=title, communication=communication_bytes(buffers))
    if offload:
        report += (
            "\n\nOffloaded to host memory: optimizer state and master weights (stages 1 and 2 keep a host copy of"
            " each shard even for an fp32 module, which the estimate does not count), and in stage 3 the parameter"
            " shards and their gradients."
        )
    return report


def optimizer_kind(optimizers: Iterable[Optimizer]) -> str | None:
    """The :data:`lightning_zero.estimate.OPTIMIZER_STATES` key of ``optimizers`` when all are of one known kind."""
    kinds = set()
    for optimizer in optimizers:
        inner = unwrap(optimizer)
        groups = inner.param_groups
        if isinstance(inner, (Adam, AdamW)) and not any(g.get("amsgrad") for g in groups):
            kinds.add("adam")
        elif isinstance(inner, torch.optim.SGD):
            kinds.add("sgd-momentum" if any(g.get("momentum", 0) for g in groups) else "sgd")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def log_info(message: str) -> None:
    """Log ``message`` on rank 0 as Lightning logs its own information (``rank_zero_info``). The console handler that
    prints it writes through ``tqdm.write`` meanwhile, so a progress bar being drawn moves below the message instead
    of running into its first line."""
    console = _console_logger(rank_zero.log)  # the logger `rank_zero_info` writes to, Lightning's
    with logging_redirect_tqdm([console]) if console is not None else nullcontext():
        rank_zero_info(message)


def _console_logger(logger: logging.Logger) -> logging.Logger | None:
    """The first logger from ``logger`` up its propagation chain with a handler printing to stdout or stderr."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(getattr(h, "stream", None) in (sys.stdout, sys.stderr) for h in current.handlers):
            return current
        current = current.parent if current.propagate else None
    return None
