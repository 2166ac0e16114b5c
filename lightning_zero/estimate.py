"""Model-state bytes per rank and per node before anything runs: the ZeRO paper's formulas for DDP and each stage.

Vocabulary (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020):

- *Psi*: the number of parameters; *N*: the number of data-parallel ranks over all nodes.
- *Model state*: parameters, gradients, fp32 master weights and optimizer state. Activations, buffers, communication
  buckets, stage 3's gathered units and the framework's own allocations come on top and are not estimated here.
- *K*: bytes per parameter of master weights plus optimizer state. fp32 Adam: K = 8 (two fp32 moments); 16-bit
  parameters with fp32 master weights (the paper's mixed precision): K = 12.

Each stage shards more of the model state over the N ranks; per rank that makes:

========  ==========  =========  ==============  ==================  ====================================
strategy  parameters  gradients  master + state  fp32 Adam           16-bit, fp32 master, Adam (K = 12)
========  ==========  =========  ==============  ==================  ====================================
ddp       whole       whole      whole           16 Psi              16 Psi
zero1     whole       whole      1/N             8 Psi + 8 Psi/N     4 Psi + 12 Psi/N
zero2     whole       1/N        1/N             4 Psi + 12 Psi/N    2 Psi + 14 Psi/N
zero3     1/N         1/N        1/N             16 Psi/N            16 Psi/N
========  ==========  =========  ==============  ==================  ====================================

With master weights, stage 3 keeps no separate copy: its fp32 parameter shards are the masters (gathered as 16-bit)
and its gradient shards are 16-bit, as stage 2's, so it holds 4 + 2 + 8 bytes per parameter / N; offloaded,
``fully_shard`` keeps fp32 gradient shards: 4 + 4 + 8.

ZeRO-Infinity (``offload_parameters="disk"``, the ``zero3_infinity`` row with ``disk=True``) holds stage 3's model
state in files: its device and host memory hold only the units at work (and ``max_in_cpu`` parameter elements), which
the estimate leaves out like activations; its disk column is stage 3's total.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero.memory import ModelStateBytes

OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}
"""Tensors of state the optimizer keeps per parameter, each the size of the parameter (step counters left out)."""

_MASTER_BYTES = 4  # fp32 master weights, and the optimizer state beside them


@dataclass(frozen=True)
class Sharding:
    """Which parts of the model state a strategy splits over the ranks; the rest every rank holds whole."""

    parameters: bool
    gradients: bool
    optimizer: bool  # the optimizer state and, where kept, the fp32 master weights
    parameters_are_masters: bool = False
    """With master weights, the sharded parameters themselves are the fp32 masters (gathered as 16-bit to compute):
    no separate master copy; their gradient shards are 16-bit (fp32 where ``fully_shard`` keeps them: offloaded)."""


STRATEGIES: dict[str, Sharding] = {
    "ddp": Sharding(parameters=False, gradients=False, optimizer=False),
    "zero1": Sharding(parameters=False, gradients=False, optimizer=True),
    "zero2": Sharding(parameters=False, gradients=True, optimizer=True),
    "zero3": Sharding(parameters=True, gradients=True, optimizer=True, parameters_are_masters=True),
}


@dataclass(frozen=True)
class MemoryEstimate:
    """The model state one rank, and one node, of a strategy holds."""

    strategy: str
    per_rank: ModelStateBytes  # bytes of each category on one rank (shares rounded up)
    ranks_per_node: int
    offload: bool  # master weights and optimizer state live in host memory instead of device memory
    on_disk: bool = False  # the whole model state lives in files (ZeRO-Infinity)

    @property
    def device_per_rank(self) -> int:
        if self.on_disk:
            return 0
        state = self.per_rank
        return state.total - self.host_per_rank if self.offload else state.total

    @property
    def host_per_rank(self) -> int:
        if self.on_disk or not self.offload:
            return 0
        return self.per_rank.master_weights + self.per_rank.optimizer_state

    @property
    def disk_per_rank(self) -> int:
        return self.per_rank.total if self.on_disk else 0

    @property
    def disk_per_node(self) -> int:
        return self.disk_per_rank * self.ranks_per_node

    @property
    def device_per_node(self) -> int:
        return self.device_per_rank * self.ranks_per_node

    @property
    def host_per_node(self) -> int:
        return self.host_per_rank * self.ranks_per_node


def parameter_bytes(precision: str | int) -> int:
    """Bytes of one parameter (and of its gradient) under a Lightning ``precision`` flag. The ``*-mixed`` flags
    autocast the compute but keep fp32 parameters, gradients and optimizer state."""
    match str(precision):
        case "64-true" | "64":
            return 8
        case "32-true" | "32" | "16-mixed" | "bf16-mixed" | "16" | "bf16":
            return 4
        case "16-true" | "bf16-true":
            return 2
        case _:
            raise ValueError(
                f"`precision={precision!r}` is not a precision the estimate knows. HINT: use one of '32-true',"
                " '16-mixed', 'bf16-mixed', '16-true', 'bf16-true' or '64-true'."
            )


def estimate(
    num_params: int,
    *,
    num_ranks: int,
    num_nodes: int = 1,
    precision: str | int = "32-true",
    master_weights: bool = False,
    offload: bool = False,
    optimizer: str = "adam",
    trainable_params: int | None = None,
    shard_group_size: int | None = None,
    disk: bool = False,
) -> dict[str, MemoryEstimate]:
    """Model-state bytes for DDP and each ZeRO stage, keyed ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` (and
    ``"zero3_infinity"`` with ``disk``).

    Args:
        num_params: Psi, the parameters of the model (a tied matrix counted once).
        num_ranks: N, data-parallel ranks over all nodes (``devices * num_nodes`` in a ``Trainer``).
        num_nodes: machines the ranks are spread evenly over; per-node bytes are per-rank bytes times ranks per node.
        precision: the ``Trainer``'s ``precision`` flag; it sets the bytes of parameters and gradients.
        master_weights: with 16-bit parameters (``"bf16-true"``, ``"16-true"``), the optimizer steps on fp32 master
            copies and keeps its state in fp32: the ZeRO paper's mixed precision (2 + 2 + 12 bytes per parameter).
            Without them the optimizer state has the parameters' dtype.
        offload: count master weights and optimizer state as host memory rather than device memory.
        optimizer: one of ``OPTIMIZER_STATES``; Adam keeps two moments per parameter.
        trainable_params: parameters that get gradients and optimizer state; by default all ``num_params``.
        shard_group_size: hybrid sharding (``shard_group_size=`` of the strategies): the stages shard over groups of
            this many ranks and replicate across groups, so their per-rank bytes divide by it instead of N.
        disk: add ZeRO-Infinity's row: stage 3's model state in files (``offload_parameters="disk"``).
    """
    trainable = num_params if trainable_params is None else trainable_params
    _check_counts(num_params, trainable, num_ranks, num_nodes)
    shards = num_ranks if shard_group_size is None else shard_group_size
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or num_ranks % shards:
        raise ValueError(
            f"`shard_group_size={shard_group_size!r}` must be a positive divisor of `num_ranks={num_ranks}`. HINT: pass"
            " the ranks of one shard group, e.g. the ranks of one node."
        )
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"`optimizer={optimizer!r}` is not known. HINT: use one of {list(OPTIMIZER_STATES)}.")
    param_bytes = parameter_bytes(precision)
    if master_weights and param_bytes >= _MASTER_BYTES:
        raise ValueError(
            f"`master_weights=True` keeps fp32 copies of 16-bit parameters, but `precision={precision!r}` trains"
            f" {8 * param_bytes}-bit parameters. HINT: use precision 'bf16-true' or '16-true' with master weights;"
            " the '*-mixed' flags already keep fp32 parameters."
        )
    state_bytes = OPTIMIZER_STATES[optimizer] * (_MASTER_BYTES if master_weights else param_bytes)
    estimates = {}
    for name, sharding in STRATEGIES.items():
        held = _MASTER_BYTES if master_weights and sharding.parameters_are_masters else param_bytes
        master_bytes = _MASTER_BYTES if master_weights and not sharding.parameters_are_masters else 0
        grad_bytes = held if offload else param_bytes
        per_rank = ModelStateBytes(
            parameters=_share(held * num_params, sharding.parameters, shards),
            gradients=_share(grad_bytes * trainable, sharding.gradients, shards),
            master_weights=_share(master_bytes * trainable, sharding.optimizer, shards),
            optimizer_state=_share(state_bytes * trainable, sharding.optimizer, shards),
        )
        estimates[name] = MemoryEstimate(name, per_rank, num_ranks // num_nodes, offload)
    if disk:
        zero3 = estimates["zero3"]
        estimates["zero3_infinity"] = MemoryEstimate("zero3_infinity", zero3.per_rank, zero3.ranks_per_node, True, True)
    return estimates


def _share(total: int, sharded: bool, num_ranks: int) -> int:
    """One rank's bytes of ``total``: all of it, or its 1/N share rounded up."""
    return math.ceil(total / num_ranks) if sharded else total


def count_parameters(class_path: str, init_args: dict[str, Any] | None = None) -> tuple[int, int]:
    """(all, trainable) parameters of the module ``class_path(**init_args)``, built on the meta device: no bytes are
    allocated, so any size can be counted. A ``configure_model`` method (a LightningModule's hook) runs too. Tied
    parameters count once."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name, None) if module_name else None
    except ModuleNotFoundError as error:
        raise ValueError(f"Cannot import {class_path!r}: {error}. HINT: give the full import path.") from error
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise ValueError(
            f"{class_path!r} is not an `nn.Module` class. HINT: give its import path, e.g."
            " `example_modules.gpt.GPTLanguageModel`."
        )
    init_args = init_args or {}
    with torch.device("meta"):
        try:
            module = cls(**init_args)
        except TypeError as error:
            raise ValueError(
                f"{class_name}(**{init_args}) failed: {error}. HINT: pass its init arguments as `--NAME VALUE`."
            ) from error
        # a LightningModule's hook, looked up by name: nothing below the front ends imports lightning.pytorch
        configure_model = getattr(module, "configure_model", None)
        if callable(configure_model):
            configure_model()
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _check_counts(num_params: int, trainable: int, num_ranks: int, num_nodes: int) -> None:
    for name, value in (("num_params", num_params), ("num_ranks", num_ranks), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}={value!r}` must be a positive integer.")
    if isinstance(trainable, bool) or not isinstance(trainable, int) or not 0 <= trainable <= num_params:
        raise ValueError(f"`trainable_params={trainable!r}` must be an integer from 0 to `num_params={num_params}`.")
    if num_ranks % num_nodes:
        raise ValueError(
            f"`num_ranks={num_ranks}` does not spread evenly over `num_nodes={num_nodes}`. HINT: `num_ranks` counts"
            " the ranks of all nodes together (devices per node times nodes)."
        )


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, as device memory is reported."""
    value, unit = float(num_bytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def format_table(estimates: dict[str, MemoryEstimate]) -> str:
    """A markdown table with a row per strategy; with offload, device and host bytes in columns of their own, and with
    a ZeRO-Infinity row, disk bytes too."""
    offload = next(iter(estimates.values())).offload
    disk = any(est.on_disk for est in estimates.values())
    if offload:
        header = [
            "strategy", "params", "grads", "optimizer+master (host)",
            "device per rank", "host per rank", "device per node", "host per node",
        ]  # fmt: skip
    elif disk:
        header = ["strategy", "params", "grads", "optimizer+master", "memory per rank", "memory per node"]
    else:
        header = ["strategy", "params", "grads", "optimizer+master", "total per rank", "total per node"]
    if disk:
        header += ["disk per rank", "disk per node"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, est in estimates.items():
        state = est.per_rank
        cells = [state.parameters, state.gradients, state.master_weights + state.optimizer_state]
        if offload:
            cells += [est.device_per_rank, est.host_per_rank, est.device_per_node, est.host_per_node]
        else:
            cells += [est.device_per_rank, est.device_per_node]
        if disk:
            cells += [est.disk_per_rank, est.disk_per_node]
        lines.append("| " + " | ".join([f"`{name}`", *map(format_bytes, cells)]) + " |")
    return "\n".join(lines)
