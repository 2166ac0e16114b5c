"""The placements ``zero_auto`` weighs, and what each holds per rank in memory, host memory and files."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lightning_zero._config import Stage
from lightning_zero._offload.target import OffloadTarget
from lightning_zero.estimate import estimate


class Offload(Enum):
    """How far ``zero_auto`` may move model state off the device (the ``offload`` option)."""

    NONE = 0  # every candidate keeps its state where it computes
    HOST = 1  # into host memory, not into files
    DISK = 2  # into host memory or files under ``offload_dir`` (ZeRO-Infinity)


class Candidate(Enum):
    """A placement, named as registered with Lightning; the members' order is that of their traffic, least first:
    stage 1 and 2 reduce gradients only, stage 3 gathers parameters twice per step as well, offload adds the host's
    copies and its optimizer step, and ZeRO-Infinity reads and writes every shard from files at each step."""

    ZERO1 = ("zero1", Stage.OPTIMIZER, OffloadTarget.DEVICE, OffloadTarget.DEVICE, Offload.NONE)
    ZERO2 = ("zero2", Stage.GRADIENTS, OffloadTarget.DEVICE, OffloadTarget.DEVICE, Offload.NONE)
    ZERO3 = ("zero3", Stage.PARAMETERS, OffloadTarget.DEVICE, OffloadTarget.DEVICE, Offload.NONE)
    ZERO2_OFFLOAD = ("zero2_offload", Stage.GRADIENTS, OffloadTarget.CPU, OffloadTarget.DEVICE, Offload.HOST)
    ZERO3_OFFLOAD = ("zero3_offload", Stage.PARAMETERS, OffloadTarget.CPU, OffloadTarget.CPU, Offload.HOST)
    ZERO3_INFINITY = ("zero3_infinity", Stage.PARAMETERS, OffloadTarget.DISK, OffloadTarget.DISK, Offload.DISK)

    def __init__(
        self, label: str, stage: Stage, optimizer: OffloadTarget, parameters: OffloadTarget, offload: Offload
    ) -> None:
        self.label = label
        self.stage = stage
        self.offload_optimizer = optimizer
        self.offload_parameters = parameters
        self.offload = offload  # the least ``offload`` option that admits it


@dataclass(frozen=True)
class Workload:
    """What the model state's bytes follow, as :func:`lightning_zero.estimate.estimate` takes it."""

    num_params: int
    trainable_params: int
    precision: str
    master_weights: bool
    optimizer: str  # a key of ``estimate.OPTIMIZER_STATES``
    num_ranks: int
    num_nodes: int = 1
    shard_group_size: int | None = None


@dataclass(frozen=True)
class Need:
    """One rank's model-state bytes under a candidate, by where they live."""

    device: int  # beside the computation: device memory on a GPU, the process's memory on the CPU
    host: int  # host memory apart from the computation's (offload)
    disk: int  # files under ``offload_dir``

    def memory(self, on_cpu: bool) -> int:
        """The bytes the computation's memory holds: on the CPU host and device are the same memory."""
        return self.device + self.host if on_cpu else self.device


def needs(workload: Workload) -> dict[Candidate, Need]:
    """Each candidate's :class:`Need`, from the ZeRO paper's formulas (:mod:`lightning_zero.estimate`).

    ``zero3_offload`` keeps all of stage 3's shards on the host (``fully_shard``'s CPU offload: parameters, gradients
    and optimizer state), and ZeRO-Infinity all of them in files; the units gathered to compute come out of the
    activation reserve, like activations."""
    common = {
        "num_ranks": workload.num_ranks,
        "num_nodes": workload.num_nodes,
        "precision": workload.precision,
        "master_weights": workload.master_weights,
        "optimizer": workload.optimizer,
        "trainable_params": workload.trainable_params,
        "shard_group_size": workload.shard_group_size,
    }
    resident = estimate(workload.num_params, **common, disk=True)
    offloaded = estimate(workload.num_params, **common, offload=True)
    zero2_offload = offloaded["zero2"]
    return {
        Candidate.ZERO1: Need(resident["zero1"].device_per_rank, 0, 0),
        Candidate.ZERO2: Need(resident["zero2"].device_per_rank, 0, 0),
        Candidate.ZERO3: Need(resident["zero3"].device_per_rank, 0, 0),
        Candidate.ZERO2_OFFLOAD: Need(zero2_offload.device_per_rank, zero2_offload.host_per_rank, 0),
        Candidate.ZERO3_OFFLOAD: Need(0, offloaded["zero3"].per_rank.total, 0),
        Candidate.ZERO3_INFINITY: Need(0, 0, resident["zero3_infinity"].disk_per_rank),
    }
