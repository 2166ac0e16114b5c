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
"""

from __future__ import annotations

import enum
import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer


class Requeue(enum.Enum):
    """Whether this rank has received the requeue signal since the last checkpoint it caused."""

    IDLE = "idle"
    SIGNALLED = "signalled"


class DeferredRequeue:
    """Lightning's handler of the requeue signal, run at a training-batch start every rank agrees on."""

    def __init__(self, signum: int, handler: Any) -> None:
        self._signum = signum
        self._handler = handler  # Lightning's own (it saves the checkpoint, rank 0 requeues the job)
        self.state = Requeue.IDLE

    @classmethod
    def install(cls, trainer: Trainer) -> DeferredRequeue | None:
        """Take over the requeue signal from Lightning, where the run requeues itself (at ``on_train_start``: Lightning
        has registered its handlers by then); None where it does not."""
        environment = trainer.strategy.cluster_environment
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return None
        signum = environment.requeue_signal
        handler = signal.getsignal(signum) if signum is not None else None
        if signum is None or not callable(handler):  # not the main thread, or Windows: Lightning registered nothing
            return None
        deferred = cls(signum, handler)
        signal.signal(signum, deferred._record)  # Lightning's teardown puts back what was there before it
        return deferred

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.state = Requeue.SIGNALLED

    def at_batch_start(self, device: torch.device) -> None:
        """Collective: if any rank was signalled, every rank runs Lightning's handler now."""
        signalled = torch.tensor([int(self.state is Requeue.SIGNALLED)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(signalled, op=dist.ReduceOp.MAX)
        if signalled.item():
            self.state = Requeue.IDLE
            self._handler(self._signum, None)
