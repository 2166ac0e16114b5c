"""User-facing options, validated once, with errors that name the option and how to fix it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import torch

from lightning_zero._offload import OffloadTarget, check_directory
from lightning_zero._wrap import ModulePolicy, RepeatedEntries, resolve_policy


class Stage(IntEnum):
    """What ZeRO shards across data-parallel ranks."""

    OPTIMIZER = 1  # optimizer state
    GRADIENTS = 2  # optimizer state and gradients
    PARAMETERS = 3  # optimizer state, gradients and parameters (torch's ``fully_shard``)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: Stage
    """1 shards optimizer state; 2 also gradients; 3 also parameters."""

    bucket_cap_mb: float = 25.0
    """Size of the buckets in which gradients are reduced and parameters gathered, in MiB (stages 1 and 2). Larger
    buckets mean fewer collective calls; smaller ones start communication earlier in backward and bound stage 2's
    staging memory."""

    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics) from rank 0 before each synchronised training step, as DDP
    does by default, so every rank trains on the same buffer values."""

    auto_wrap_policy: ModulePolicy = field(default_factory=RepeatedEntries)
    """Stage 3: which submodules become units of their own, all-gathered just before their forward and freed after
    it (and again in backward); everything else lives in the root unit, gathered for the whole step."""

    activation_checkpointing: ModulePolicy | None = None
    """Which submodules recompute their activations in backward instead of keeping them (any stage)."""

    master_weights: bool = False
    """ZeRO mixed precision: with a 16-bit module (``precision="bf16-true"``, or ``"16-true"`` in stages 1 and 2),
    parameters and gradients stay 16-bit in the module and on the wire, while the optimizer steps on an fp32 master
    copy of this rank's shard only (in stage 3 the fp32 shards are the masters, gathered as bf16); fp16 gradients
    get dynamic loss scaling that skips a step on every rank when any rank overflows."""

    reduce_dtype: torch.dtype | None = None
    """Stages 2 and 3: dtype gradients are reduced in; ``torch.float32`` for accuracy with a 16-bit module.
    ``None``: the parameters' dtype, half the traffic."""

    offload_optimizer: OffloadTarget = OffloadTarget.DEVICE
    """Where the fp32 masters, optimizer state and optimizer step live: on the device, on the host (``"cpu"``), or on
    the host with the optimizer state in memory-mapped files under ``offload_dir`` (``"disk"``). In stage 3 the shards
    are the optimizer's parameters, so they and their gradients move to the host with it."""

    offload_parameters: bool = False
    """Stage 3: keep the parameter shards on the host; each unit comes to the device only while it is gathered. The
    optimizer then steps on the host too (it updates those shards)."""

    offload_dir: Path | None = None
    """The directory of ``offload_optimizer="disk"``: a local disk with room for this node's optimizer state."""

    pin_memory: bool = True
    """Page-lock host copies of a CUDA module's state, so transfers run asynchronously at full speed."""

    @property
    def offload(self) -> OffloadTarget:
        """Where the optimizer lives, ``offload_parameters`` included (it takes the optimizer to the host)."""
        if self.offload_parameters and self.offload_optimizer is OffloadTarget.DEVICE:
            return OffloadTarget.CPU
        return self.offload_optimizer
    memory_report: bool = True
    """Log, on rank 0 right after the first optimizer step of each ``fit``, this rank's measured model-state bytes
    beside the ZeRO paper's estimate for the same stage, ranks and precision."""

    @classmethod
    def from_options(
        cls,
        *,
        stage: object,
        bucket_cap_mb: object,
        broadcast_buffers: object,
        auto_wrap_policy: object = None,
        activation_checkpointing: object = None,
        master_weights: object = False,
        reduce_dtype: object = None,
        offload_optimizer: object = False,
        offload_parameters: object = False,
        offload_dir: object = None,
        pin_memory: object = True,
        memory_report: object = True,
    ) -> ZeroConfig:
        valid = [s.value for s in Stage]
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in valid:
            raise ValueError(
                f"`stage={stage!r}` is not a ZeRO stage this strategy runs. HINT: pass `stage` as one of {valid}."
            )
        numeric = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
        # NaN and infinity would fail in `fit`, converted to a byte count (NaN lies in no interval)
        if not numeric or not 0 < bucket_cap_mb < math.inf:  # type: ignore[operator]
            raise ValueError(
                f"`bucket_cap_mb={bucket_cap_mb!r}` must be a finite, positive number of MiB. HINT: the default, 25,"
                " suits most models."
            )
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"`broadcast_buffers={broadcast_buffers!r}` must be True or False.")
        if auto_wrap_policy is not None and stage != Stage.PARAMETERS:
            raise ValueError(
                f"`auto_wrap_policy` shapes the units of stage 3; stage {stage} keeps full parameters."
                " HINT: use `Zero3Strategy` (or `stage=3`), or drop `auto_wrap_policy`."
            )
        wrap = resolve_policy("auto_wrap_policy", auto_wrap_policy)
        match activation_checkpointing:
            case None | False:
                checkpointing = None
            case True:
                checkpointing = wrap  # the modules the wrap policy picks (the repeated entries in stages 1 and 2)
            case _:
                checkpointing = resolve_policy("activation_checkpointing", activation_checkpointing)
        if not isinstance(master_weights, bool):
            raise ValueError(f"`master_weights={master_weights!r}` must be True or False.")
        if not isinstance(memory_report, bool):
            raise ValueError(
                f"`memory_report={memory_report!r}` must be True or False. HINT: `memory_report=False` turns the"
                " report off."
            )
        dtype = _resolve_dtype(reduce_dtype)
        if dtype is not None and stage == Stage.OPTIMIZER:
            raise ValueError(
                "`reduce_dtype` applies to the gradient shards of stages 2 and 3; stage 1 keeps full gradients in the"
                " parameters' dtype. HINT: use `Zero2Strategy`, or drop `reduce_dtype`."
            )
        offload = _resolve_offload(offload_optimizer)
        if not isinstance(offload_parameters, bool):
            raise ValueError(f"`offload_parameters={offload_parameters!r}` must be True or False.")
        if offload_parameters and stage != Stage.PARAMETERS:
            raise ValueError(
                f"`offload_parameters=True` moves the parameter shards of stage 3 to the host; stage {stage} keeps full"
                " parameters on the device. HINT: use `Zero3Strategy` (or `\"zero3_offload\"`), or offload only the"
                " optimizer with `offload_optimizer=True`."
            )
        if not isinstance(pin_memory, bool):
            raise ValueError(f"`pin_memory={pin_memory!r}` must be True or False.")
        directory = None
        if offload is OffloadTarget.DISK:
            if not isinstance(offload_dir, (str, Path)) or not str(offload_dir):
                raise ValueError(
                    f"`offload_optimizer='disk'` keeps optimizer state in files, but `offload_dir={offload_dir!r}`."
                    " HINT: pass `offload_dir` as the path of a directory on a local disk (e.g. an NVMe drive)."
                )
            directory = check_directory("offload_dir", Path(offload_dir))
        elif offload_dir is not None:
            raise ValueError(
                f"`offload_dir={offload_dir!r}` is used only by `offload_optimizer='disk'`."
                " HINT: pass `offload_optimizer='disk'` as well, or drop `offload_dir`."
            )
        return cls(
            stage=Stage(stage),
            bucket_cap_mb=float(bucket_cap_mb),
            broadcast_buffers=broadcast_buffers,
            auto_wrap_policy=wrap,
            activation_checkpointing=checkpointing,
            master_weights=master_weights,
            reduce_dtype=dtype,
            offload_optimizer=offload,
            offload_parameters=offload_parameters,
            offload_dir=directory,
            pin_memory=pin_memory,
            memory_report=memory_report,
        )

    @property
    def master_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.master_weights else None

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)


_REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(value: object) -> torch.dtype | None:
    if value is None or value in _REDUCE_DTYPES.values():
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value.removeprefix("torch.") in _REDUCE_DTYPES:
        return _REDUCE_DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"`reduce_dtype={value!r}` is not a dtype to reduce in. HINT: use one of {list(_REDUCE_DTYPES)}.")


def _resolve_offload(value: object) -> OffloadTarget:
    match value:
        case False | None | "none":
            return OffloadTarget.DEVICE
        case True | "cpu":
            return OffloadTarget.CPU
        case "disk" | "nvme":
            return OffloadTarget.DISK
    raise ValueError(
        f"`offload_optimizer={value!r}` is not a place for the optimizer. HINT: use False, True (or \"cpu\") for host"
        " memory, or \"disk\" with `offload_dir` for memory-mapped files."
    )
