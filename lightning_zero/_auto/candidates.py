"""The placements ``zero_auto`` weighs, and what each holds per rank in memory, host memory and files."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from lightning_zero._config import Stage
from lightning_zero._offload.kernels import FUSED_ON_SHARDS
from lightning_zero._offload.target import OffloadTarget
from lightning_zero._transport.shared_memory import RING_SIZE
from lightning_zero.estimate import estimate, parameter_bytes

STEP_TEMPORARIES = 4  # bytes per element the optimizer steps: one fp32 temporary (Adam's denominators)
TENSOR_OBJECTS = 64 * 1024
"""Bytes per parameter tensor that stage 3 holds on CPU ranks beside the tensors' data, whatever their size:
``fully_shard``'s and the package's objects for each parameter and unit, and the small blocks its first step leaves
free between them. Measured on 2 ranks, stacks of ``Linear(64)`` built in ``configure_model`` from 256 to 1,024 units,
anonymous memory after 3 steps: ZeRO-Infinity 37 KiB a tensor and 29 KiB a unit (46 KiB a tensor at one layer a
unit), ``zero3`` 41 KiB a tensor at one layer a unit (its model state apart). On a model of thousands of parameter
tensors this is hundreds of MiB, whatever its state."""
# the optimizers (as ``estimate.OPTIMIZER_STATES`` keys them) whose step on host tensors runs torch's fused kernel
FUSED_ON_HOST = tuple(kind.__name__.lower() for kind in FUSED_ON_SHARDS)


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
class Working:
    """What sizes a step's working buffers beside the model state: stage 3's units (as the wrap policy picks them)
    and the buckets."""

    largest_unit: int  # parameters of the largest unit but the root
    root_params: int  # parameters of the root unit's own, gathered through the step
    bucket_bytes: int  # ``bucket_cap_mb``
    keep_bytes: int  # ``keep_for_backward_mb``
    prefetch_units: int = 2  # ZeRO-Infinity's units read ahead
    parameter_tensors: int = 0  # the module's, each with stage 3's objects beside it (:data:`TENSOR_OBJECTS`)


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
    working: Working | None = None  # ``None``: model state alone is weighed


@dataclass(frozen=True)
class Need:
    """One rank's model-state bytes under a candidate, by where they live, and the step's working buffers."""

    device: int  # beside the computation: device memory on a GPU, the process's memory on the CPU
    host: int  # host memory apart from the computation's (offload)
    disk: int  # files under ``offload_dir``
    working: int = 0  # beside the computation: buckets, gathered units, the optimizer step's temporaries

    def memory(self, on_cpu: bool) -> int:
        """The bytes the computation's memory holds: on the CPU host and device are the same memory."""
        return self.working + (self.device + self.host if on_cpu else self.device)


def host_steps_first(optimizer: str, on_cpu: bool) -> bool:
    """Whether the candidates whose optimizer steps on the host come first: on CPU ranks stepping Adam or AdamW. There
    the host is the device, so offloading moves nothing across a bus, and the host step runs torch's fused kernel
    (about six times as fast as the multi-tensor kernels, which the in-memory stages run because they match ``ddp``'s
    per-parameter loop bit for bit; the fused kernel differs in the last bits, which Adam can amplify where a gradient
    is rounding noise)."""
    return on_cpu and optimizer in FUSED_ON_HOST


def order(optimizer: str, on_cpu: bool) -> list[Candidate]:
    """The candidates in the order the choice weighs them, the fastest expected first: by their traffic, those whose
    optimizer steps on the host first where :func:`host_steps_first`."""
    candidates = list(Candidate)
    if not host_steps_first(optimizer, on_cpu):
        return candidates
    on_host = [c for c in candidates if c.offload_optimizer is OffloadTarget.CPU]
    return on_host + [c for c in candidates if c not in on_host]


def needs(workload: Workload, on_cpu: bool = False) -> dict[Candidate, Need]:
    """Each candidate's :class:`Need`, from the ZeRO paper's formulas (:mod:`lightning_zero.estimate`), on CPU ranks
    (``on_cpu``: host and device are one memory) or beside a GPU.

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
    state = {
        Candidate.ZERO1: Need(resident["zero1"].device_per_rank, 0, 0),
        Candidate.ZERO2: Need(resident["zero2"].device_per_rank, 0, 0),
        Candidate.ZERO3: Need(resident["zero3"].device_per_rank, 0, 0),
        Candidate.ZERO2_OFFLOAD: Need(zero2_offload.device_per_rank, zero2_offload.host_per_rank, 0),
        Candidate.ZERO3_OFFLOAD: Need(0, offloaded["zero3"].per_rank.total, 0),
        Candidate.ZERO3_INFINITY: Need(0, 0, resident["zero3_infinity"].disk_per_rank),
    }
    if workload.working is None:
        return state
    sizes = workload.working
    return {c: replace(need, working=working_bytes(c, workload, sizes, on_cpu)) for c, need in state.items()}


def working_bytes(candidate: Candidate, workload: Workload, sizes: Working, on_cpu: bool = False) -> int:
    """One rank's working buffers during a step under ``candidate``, beside its model state: the optimizer step's
    temporaries (one fp32 element per element it steps: the whole shard at once, or ZeRO-Infinity's one unit), two
    buckets of gradients being staged and reduced, and in stage 3 the root and the units gathered whole at once (the
    one running, the next one prefetched, the ones kept for backward; ZeRO-Infinity's units read ahead) with the gather
    ring's buffers on a host of several ranks, and on CPU ranks its objects beside each parameter tensor
    (:data:`TENSOR_OBJECTS`; beside a GPU they are host memory, small beside the offloaded state weighed there)."""
    element = parameter_bytes(workload.precision)
    shards = workload.shard_group_size or workload.num_ranks
    staging = min(2 * sizes.bucket_bytes, workload.trainable_params * element)
    unit, root = sizes.largest_unit * element, sizes.root_params * element
    ring = RING_SIZE * unit if workload.num_ranks // workload.num_nodes > 1 else 0
    temporaries = _step_temporaries(candidate, workload.optimizer, on_cpu)
    stepped = math.ceil(workload.trainable_params / shards) * temporaries
    objects = sizes.parameter_tensors * TENSOR_OBJECTS if on_cpu else 0
    match candidate:
        case Candidate.ZERO1 | Candidate.ZERO2 | Candidate.ZERO2_OFFLOAD:
            return stepped + staging
        case Candidate.ZERO3:
            kept = min(sizes.keep_bytes, (workload.num_params - sizes.root_params) * element)
            return stepped + staging + root + unit + kept + ring + objects
        case Candidate.ZERO3_OFFLOAD:
            return stepped + staging + root + 2 * unit + ring + objects
        case Candidate.ZERO3_INFINITY:
            one_unit = math.ceil(sizes.largest_unit / shards) * temporaries
            return one_unit + staging + root + (2 + sizes.prefetch_units) * unit + ring + objects


def _step_temporaries(candidate: Candidate, optimizer: str, on_cpu: bool) -> int:
    """The bytes per stepped element that the optimizer step allocates beside the computation: one fp32 temporary
    under the multi-tensor kernels; none where the optimizer steps on the host, beside a GPU (not the computation's
    memory) or with torch's fused kernel, in place (Adam and AdamW, as :mod:`lightning_zero._offload.kernels`
    chooses)."""
    if candidate.offload_optimizer is not OffloadTarget.DEVICE and (optimizer in FUSED_ON_HOST or not on_cpu):
        return 0
    return STEP_TEMPORARIES
