"""The one error every check of a checkpoint raises (what is wrong, with which file, then a HINT), and the kinds a
reader may catch by name."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded as it is."""


class StateNotSaved(CheckpointError):
    """A load asked a checkpoint for state it was saved without: optimizer state of a weights-only save, or of a
    DeepSpeed checkpoint without its optimizer files."""


class NoCheckpoint(CheckpointError, FileNotFoundError):
    """Nothing is at the path a load was given."""


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
