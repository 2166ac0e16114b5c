"""SLURM's requeue signal (``SLURMEnvironment(auto_requeue=True)``: SIGUSR1 before the job's time runs out), acted on
between two training steps, on every rank at the same one.

Lightning saves its ``hpc_ckpt_<n>.ckpt`` and requeues the job from inside the signal handler, wherever the main
thread is when the signal lands: in a forward with stage 3's units gathered, between a shard's update and the gather
of the updated parameters, in a shared-memory collective whose peers wait for its next status byte, in a save. Under
``"ddp"`` such a checkpoint can hold the weights of one step beside the counters of the step before (the optimizer
stepped, Lightning had not yet counted it), so the resumed run trains that step twice; under sharding the save's own
collectives would also interleave with the step's, on ranks that each got the signal at another point.

So here the handler only *records* the signal. At the start of each training batch (the previous step, its callbacks
and its counters complete, nothing gathered, no collective in flight) the ranks agree whether any of them recorded one
(a one-element all-reduce, only in runs with auto-requeue), and if so all run Lightning's own handler there: the
checkpoint holds the weights, optimizer state and counters of one step, and the job is requeued as before. A signal
that lands during validation or a save waits for the next training batch; one that lands after the last batch is
not acted on (the run has finished: nothing to requeue).

The resumed job loads the ``hpc_ckpt`` with the highest number in ``default_root_dir``, which Lightning reads from
every name there that holds ``hpc_ckpt_``, joining all its digits: a save killed half-way (SLURM's kill after the
signal's grace time) leaves its hidden staging directory, ``.hpc_ckpt_2.ckpt.partial-<saver>-...``, whose digits make
a number no checkpoint has. :func:`resumable` then loads the highest complete one instead, and removes such leftovers
of savers that are dead.
"""

from __future__ import annotations

import enum
import os
import re
import signal
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer

from lightning_zero._checkpoint import publish

_HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")
_HPC_STAGING = re.compile(r"\.(hpc_ckpt_\d+\.ckpt)\.partial\b.*")  # a save's staging directory, see publish


class Requeue(enum.Enum):
    """Whether this rank has received the requeue signal since the last checkpoint it caused."""

    IDLE = "idle"
    SIGNALLED = "signalled"


class DeferredRequeue:
    """Lightning's handler of the requeue signal, run at a training-batch start every rank agrees on.

    The ranks agree through a one-element all-reduce on the run's device. On the CPU its result is read at once; on
    a GPU reading it would make the host wait for the device every step, so it is copied to the host asynchronously
    and read at the next batch start, a step later: every rank reads the same result at the same batch."""

    def __init__(self, signum: int, handler: Any) -> None:
        self._signum = signum
        self._handler = handler  # Lightning's own (it saves the checkpoint, rank 0 requeues the job)
        self.state = Requeue.IDLE
        # on a GPU: the previous batch's agreement on its way to the host, and the event that says it has arrived
        self._arriving: tuple[torch.Tensor, torch.cuda.Event] | None = None

    @classmethod
    def install(cls, trainer: Trainer) -> DeferredRequeue | None:
        """Take over the requeue signal from Lightning, where the run requeues itself (at ``on_train_start``: Lightning
        has registered its handlers by then); None where it does not."""
        environment = trainer.strategy.cluster_environment
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return None
        signum = environment.requeue_signal
        if signum is None or threading.current_thread() is not threading.main_thread():
            return None  # Windows, or a run off the main thread: Lightning registered no handler either
        handler = signal.getsignal(signum)
        if not callable(handler):
            return None
        deferred = cls(signum, handler)
        signal.signal(signum, deferred._record)  # Lightning's teardown puts back what was there before it
        return deferred

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.state = Requeue.SIGNALLED

    def at_batch_start(self, device: torch.device) -> None:
        """Collective: if any rank was signalled (by the previous batch start, on a GPU), every rank runs Lightning's
        handler now."""
        signalled = torch.tensor([int(self.state is Requeue.SIGNALLED)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(signalled, op=dist.ReduceOp.MAX)
        if device.type == "cpu":
            agreed = bool(signalled.item())  # a host tensor: nothing to wait for
        else:
            agreed = self._arrived()
            host = torch.empty(1, dtype=signalled.dtype, pin_memory=True)
            host.copy_(signalled, non_blocking=True)
            arrival = torch.cuda.Event()
            arrival.record()
            self._arriving = (host, arrival)
        if agreed:
            self.state = Requeue.IDLE
            self._arriving = None  # the flags sent meanwhile are this same signal's
            self._handler(self._signum, None)

    def _arrived(self) -> bool:
        """The previous batch's agreement, copied to the host a whole step ago (its event long complete)."""
        if self._arriving is None:
            return False
        host, arrival = self._arriving
        arrival.synchronize()
        return bool(host.item())


def resumable(path: Path, is_global_zero: bool) -> Path:
    """``path``, or where ``path`` is an ``hpc_ckpt`` that does not exist (Lightning counted the digits of other names
    that hold ``hpc_ckpt_``: a dead save's leftovers), the highest complete ``hpc_ckpt`` beside it, the same on every
    rank; rank 0 removes the leftovers whose saver is dead."""
    if _HPC_CHECKPOINT.fullmatch(path.name) is None or os.path.lexists(path) or not path.parent.is_dir():
        return path
    names = os.listdir(path.parent)
    numbers = [int(m[1]) for name in names if (m := _HPC_CHECKPOINT.fullmatch(name))]
    if not numbers:
        return path
    latest = path.parent / f"hpc_ckpt_{max(numbers)}.ckpt"
    if is_global_zero:
        leftovers = sorted({m[1] for name in names if (m := _HPC_STAGING.fullmatch(name))})
        warnings.warn(
            f"{path.name} does not exist: Lightning numbered it after other names in {path.parent} that hold"
            f" `hpc_ckpt_` (leftovers of saves that did not finish, of {', '.join(leftovers) or 'no checkpoint'}: a"
            f" job killed while saving), so {latest.name}, the latest complete one, is loaded; the leftovers whose"
            " saver is dead are removed.",
            stacklevel=2,
        )
        for name in leftovers:  # staging directories only: a kept copy is a checkpoint (hpc saves never make one)
            target = path.parent / name
            publish.reclaim(target, keep=publish.kept_copy(target).__eq__)
    return latest
