"""User-facing options, validated once, with errors that name the option and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Stage(IntEnum):
    """What ZeRO shards across data-parallel ranks."""

    OPTIMIZER = 1  # optimizer state
    GRADIENTS = 2  # optimizer state and gradients


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: Stage
    """1 shards optimizer state; 2 also gradients."""

    bucket_cap_mb: float = 25.0
    """Size of the buckets in which gradients are reduced and parameters gathered, in MiB. Larger buckets mean fewer
    collective calls; smaller ones start communication earlier in backward and bound stage 2's staging memory."""

    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics) from rank 0 before each synchronised training step, as DDP
    does by default, so every rank trains on the same buffer values."""

    @classmethod
    def from_options(cls, *, stage: object, bucket_cap_mb: object, broadcast_buffers: object) -> ZeroConfig:
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
        return cls(stage=Stage(stage), bucket_cap_mb=float(bucket_cap_mb), broadcast_buffers=broadcast_buffers)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)
