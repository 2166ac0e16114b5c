"""User-facing options, validated once, with errors that name the option and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

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
        memory_report: object = True,
    ) -> ZeroConfig:
        valid = [s.value for s in Stage]
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in valid:
            raise ValueError(
                f"`stage={stage!r}` is not a ZeRO stage this strategy runs. HINT: pass `stage` as one of {valid}."
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(
                f"`bucket_cap_mb={bucket_cap_mb!r}` must be a positive number of MiB. HINT: the default, 25, suits most"
                " models."
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
        return cls(
            stage=Stage(stage),
            bucket_cap_mb=float(bucket_cap_mb),
            broadcast_buffers=broadcast_buffers,
            auto_wrap_policy=wrap,
            activation_checkpointing=checkpointing,
            master_weights=master_weights,
            reduce_dtype=dtype,
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
