"""The one error every check of a checkpoint raises: what is wrong, with which file, then a HINT."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded as it is."""


# The ways out of a refused unpickling, for every file that honours them (see :mod:`.unpickling`).
# Lightning 2.6 does not pass `fit(..., weights_only=False)` on to a strategy that restores after setup (this one,
# like its FSDP and DeepSpeed strategies), so torch's own allow-list is the way in through the Trainer.
TRUST_HINT = (
    "HINT: only for a checkpoint you trust: allow exactly these with `torch.serialization.add_safe_globals([...])`"
    " before `fit`/`validate`/`test`/`predict` (Lightning 2.6 does not pass their `weights_only=False` on to this"
    " strategy), or consolidate it with `consolidate_checkpoint(..., trust_pickle=True)` (`--trust-pickle`)."
)

# The way out of a damaged or incomplete checkpoint.
DAMAGE_HINT = (
    "HINT: copy the whole checkpoint directory again from where it was written, or resume from an earlier checkpoint."
)
