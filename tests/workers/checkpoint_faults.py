"""Runs inside each of N processes (started by tests/launch.py) for the checkpoint fault tests; ``argv``: the
directory, whose payload names the :class:`~tests.scenarios.FaultPhase` to run and the checkpoints it works on.

Deaths are real: a process saving a checkpoint kills itself with SIGKILL at a chosen step, by wrapping the helper the
publish calls at that step (:mod:`lightning_zero._checkpoint.publish`, ``os.rename``) or DCP's file writer; the
package has no hook for it.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.checkpoint import FileSystemWriter

import lightning_zero  # noqa: F401
from lightning_zero import CheckpointError
from tests.scenarios import MODULE_KWARGS, FaultPhase, cpu_trainer, read_payload
from tests.workers.modules import Classifier

OLD_STEPS, NEW_STEPS, LATER_STEPS = 4, 6, 8
FILE_SIZE_LIMIT = 64 * 2**10  # bytes: more than a rank's log, less than its shard file of the module below
LARGE_HIDDEN = 160  # a shard file of about 300 KiB per rank (weights and Adam's two moments)
SAVES = 12  # per job, in save_repeatedly
SAVED_ROWS = 64  # of the one tensor save_repeatedly saves
# Where a publish over an existing checkpoint can die, for each way of replacing it, and which checkpoint the target
# must then hold.
PUBLISH_STEPS = {
    "exchange": {"before_swap": "old", "after_swap": "new", "while_removing_old": "new"},
    "two_renames": {
        "before_first_rename": "old",
        "between_renames": "old",
        "after_second_rename": "new",
        "while_removing_old": "new",
    },
}


class StepAtStart(pl.Callback):
    """The step a run resumed from: the step of the checkpoint it loaded."""

    def __init__(self) -> None:
        self.step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def case_target(out: Path, swap: str, step: str) -> Path:
    return out / swap / step / "checkpoints" / "checkpoint"


def fit(
    max_steps: int, ckpt_path: Path | None = None, hidden: int = MODULE_KWARGS["hidden"], **kwargs: Any
) -> tuple[pl.Trainer, StepAtStart]:
    pl.seed_everything(0)
    start = StepAtStart()
    t = cpu_trainer("zero2", max_steps, callbacks=[start])
    t.fit(Classifier(**{**MODULE_KWARGS, "hidden": hidden}), ckpt_path=ckpt_path, **kwargs)
    return t, start


def weights(t: pl.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.lightning_module.state_dict().items()}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(swap: str, step: str, target: Path) -> None:
    """Wrap the helper the publish of ``target`` calls at ``step`` so that the process dies there; for
    ``"two_renames"`` the filesystem refuses RENAME_EXCHANGE, as NFS does."""
    from lightning_zero._checkpoint import publish  # only the phases that die in a publish need it
    if swap == "two_renames":

        def refuse(staging: Path, existing: Path) -> None:
            (target.parents[1] / "refused").touch()  # the test checks this case took the two renames
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(staging), None, str(existing))

        publish.exchange = refuse
    if step == "while_removing_old":
        remove = publish.remove

        def remove_one_file_then_die(path: Path) -> None:
            if path.is_dir() and not path.is_symlink():
                (path / "__0_0.distcp").unlink()
                die()
            remove(path)

        publish.remove = remove_one_file_then_die
    elif swap == "exchange":
        exchange = publish.exchange

        def exchange_and_die(staging: Path, existing: Path) -> None:
            if step == "before_swap":
                die()
            exchange(staging, existing)
            die()

        publish.exchange = exchange_and_die
    else:
        rename = os.rename

        def rename_and_die(source: Any, destination: Any, *args: Any, **kwargs: Any) -> None:
            first, second = Path(source) == target, Path(destination) == target
            if first and step == "before_first_rename":
                die()
            rename(source, destination, *args, **kwargs)
            if (first and step == "between_renames") or (second and step == "after_second_rename"):
                die()

        os.rename = rename_and_die


def write_then_die(original: Callable[..., Any]) -> Callable[..., Any]:
    def write(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        original(self, plan, planner)
        die()

    return write


def saved_tensor(job: int, save: int) -> torch.Tensor:
    """The tensor save ``save`` of job ``job`` writes: unlike any other's."""
    return torch.arange(SAVED_ROWS * 3, dtype=torch.float32).reshape(SAVED_ROWS, 3) + 1000 * job + save


def save_repeatedly(out: Path, job: int) -> None:
    """Save :data:`SAVES` checkpoints of one row-sharded tensor to ``out/checkpoint``, as a job does while another
    job saves to the same path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_zero._checkpoint.directory import save
    from lightning_zero._checkpoint.ranks import Ranks

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for index in range(SAVES):
        tensor = distribute_tensor(saved_tensor(job, index), mesh, [Shard(0)])
        meta = {"checkpoint": {"job": job, "save": index}, "param_groups": {}, "sharded": {}}
        save({"model/tensor": tensor}, meta, out / "checkpoint", Ranks.of_default_group())
    torch.distributed.destroy_process_group()


def main() -> None:
    out = Path(sys.argv[1])
    payload = read_payload(out)
    phase, paths = payload["phase"], payload["paths"]
    rank = int(os.environ.get("RANK", 0))
    if phase is FaultPhase.SAVE:
        t, _ = fit(OLD_STEPS)
        t.save_checkpoint(out / "checkpoint")
        if rank == 0:
            torch.save(weights(t), out / "weights.pt")
    elif phase is FaultPhase.RESUME_EACH:
        errors = {}
        for path in paths:
            try:
                fit(OLD_STEPS, path)
                errors[str(path)] = None
            except CheckpointError as error:
                errors[str(path)] = str(error)
        (out / f"errors-rank{rank}.json").write_text(json.dumps(errors))
    elif phase is FaultPhase.KILL_DURING_PUBLISH:
        old, _ = fit(OLD_STEPS)
        new, _ = fit(NEW_STEPS)
        torch.save(weights(old), out / "old.pt")
        torch.save(weights(new), out / "new.pt")
        # Each doomed save runs in a child forked from this one process, which imports and trains once for all;
        # without a process group, a save is one process's own.
        torch.distributed.destroy_process_group()
        signals = {}
        for swap, steps in PUBLISH_STEPS.items():
            for step in steps:
                target = case_target(out, swap, step)
                old.save_checkpoint(target)
                child = os.fork()
                if child == 0:
                    kill_at(swap, step, target)
                    new.save_checkpoint(target)
                    os._exit(0)  # survived: the parent reports it
                _, status = os.waitpid(child, 0)
                signals[f"{swap}/{step}"] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        (out / "signals.json").write_text(json.dumps(signals))
    elif phase is FaultPhase.KILL_DURING_WRITE:
        target = out / "checkpoints" / "checkpoint"
        t, _ = fit(OLD_STEPS)
        t.save_checkpoint(target)
        if rank == 0:
            torch.save(weights(t), out / "old.pt")
        t, _ = fit(NEW_STEPS)
        FileSystemWriter.write_data = write_then_die(FileSystemWriter.write_data)
        t.save_checkpoint(target)
        raise AssertionError("the save survived")
    elif phase is FaultPhase.FILE_SIZE_LIMIT:  # rank 1 may write no file past FILE_SIZE_LIMIT bytes
        target = out / "checkpoints" / "checkpoint"
        t, _ = fit(OLD_STEPS, hidden=LARGE_HIDDEN)
        t.save_checkpoint(target)
        if rank == 0:
            torch.save(weights(t), out / "old.pt")
        t, _ = fit(NEW_STEPS, hidden=LARGE_HIDDEN)
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, resource.RLIM_INFINITY))
        try:
            t.save_checkpoint(target)
            error = None
        except CheckpointError as failure:
            error = f"{type(failure).__name__}: {failure}"
        (out / f"error-rank{rank}.json").write_text(json.dumps(error))
    elif phase is FaultPhase.SAVE_REPEATEDLY:
        save_repeatedly(paths[0], payload["job"])
    elif phase is FaultPhase.RESUME_AND_SAVE:
        steps = {}
        for target in paths:
            t, start = fit(LATER_STEPS, target)
            t.save_checkpoint(target)
            steps[str(target)] = start.step
        if rank == 0:
            (out / "resumed.json").write_text(json.dumps(steps))
    else:
        raise ValueError(phase)


if __name__ == "__main__":
    main()
