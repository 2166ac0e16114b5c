"""A save the operating system refuses, and saves of two live jobs to one path.

- The operating system refuses a write (a full disk, a quota, a read-only filesystem, a file size limit): every rank
  raises the same `CheckpointError` naming the error and the file, with a HINT; the previous checkpoint stays; the
  failed save leaves nothing. Tested with `RLIMIT_FSIZE` on one rank of two (SIGXFSZ ignored, so a write past it
  fails with EFBIG, as at a filesystem's largest file) and, where the test may mount one, a 1 MiB tmpfs (ENOSPC),
  then remounted read-only (EROFS).
- Two jobs of 2 ranks save to one path at the same time, 12 times each: both finish, and the path holds one complete
  checkpoint, the last of one job, bit for bit, and nothing beside it. A staging directory goes only once its saver is
  dead (tested with real processes, one alive, one exited).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_zero import CheckpointError, consolidate_checkpoint
from lightning_zero._checkpoint import publish
from tests.scenarios import FaultPhase, start_phase
from tests.test_checkpoint_trust import fit_and_save
from tests.workers.checkpoint_faults import FILE_SIZE_LIMIT, LARGE_HIDDEN, SAVES, saved_tensor

pytestmark = pytest.mark.slow  # every test here launches processes

WORKER = "tests.workers.checkpoint_faults"


def assert_holds_old_checkpoint(target: Path, weights: dict[str, torch.Tensor], steps: int, tmp: Path) -> None:
    old = torch.load(consolidate_checkpoint(target, tmp / "old.ckpt"))
    assert old["global_step"] == steps
    for key, value in weights.items():
        assert torch.equal(old["state_dict"][key], value), key


def test_a_write_past_the_file_size_limit_fails_alike_on_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = start_phase(WORKER, FaultPhase.FILE_SIZE_LIMIT, tmp_path, 2, logs=logs)
    codes = [proc.wait(timeout=300) for proc in procs]
    assert codes == [0, 0], [(logs / f"rank{r}.log").read_text()[-3000:] for r in range(2)]
    errors = [json.loads((tmp_path / f"error-rank{rank}.json").read_text()) for rank in range(2)]
    assert errors[0] == errors[1]  # the same type and message on both ranks
    target = tmp_path / "checkpoints" / "checkpoint"
    assert errors[0].startswith(f"CheckpointError: Saving checkpoint {target} failed: rank 1 could not write")
    assert "[Errno 27] File too large" in errors[0]
    assert "HINT: raise the file size limit (`ulimit -f`" in errors[0]
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint"]  # the staging directory is gone
    assert_holds_old_checkpoint(target, torch.load(tmp_path / "old.pt"), 4, tmp_path)
    assert max(f.stat().st_size for f in target.iterdir()) > FILE_SIZE_LIMIT  # a shard file does pass the limit


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Path:
    mount = tmp_path / "mnt"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_then_read_only_filesystem_is_named_and_the_save_leaves_nothing(
    small_filesystem: Path, tmp_path: Path
) -> None:
    target = small_filesystem / "checkpoint"
    old = fit_and_save(target, hidden=LARGE_HIDDEN)  # about 0.6 MiB: a second copy does not fit
    weights = {k: v.detach().clone() for k, v in old.lightning_module.state_dict().items()}
    trainer = fit_and_save(None, hidden=LARGE_HIDDEN, steps=6)
    with pytest.raises(CheckpointError, match=r"\[Errno 28\] No space left on device.*HINT: free space") as full:
        trainer.save_checkpoint(target)
    assert str(full.value).startswith(f"Saving checkpoint {target} failed: rank 0 could not write {small_filesystem}")
    assert sorted(p.name for p in small_filesystem.iterdir()) == ["checkpoint"]
    assert_holds_old_checkpoint(target, weights, 4, tmp_path)
    subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True)
    with pytest.raises(CheckpointError, match=r"\[Errno 30\] Read-only file system.*HINT: save to a writable"):
        trainer.save_checkpoint(target)
    assert_holds_old_checkpoint(target, weights, 4, tmp_path)


def test_two_live_jobs_saving_to_one_path_both_finish(tmp_path: Path) -> None:
    jobs = []
    for job in range(2):
        logs = tmp_path / f"logs{job}"  # also where the job's payload is
        logs.mkdir()
        jobs.append(start_phase(WORKER, FaultPhase.SAVE_REPEATEDLY, logs, 2, logs=logs, paths=[tmp_path], job=job))
    codes = [[proc.wait(timeout=300) for proc in procs] for procs in jobs]
    outputs = [(tmp_path / f"logs{j}" / f"rank{r}.log").read_text()[-2000:] for j in range(2) for r in range(2)]
    assert codes == [[0, 0], [0, 0]], outputs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "logs0", "logs1"]
    saved = torch.load(consolidate_checkpoint(tmp_path / "checkpoint", tmp_path / "out.ckpt"))
    assert saved["save"] == SAVES - 1 and saved["job"] in (0, 1)
    assert torch.equal(saved["state_dict"]["tensor"], saved_tensor(saved["job"], SAVES - 1))


def make_staging_in_child(target: Path, stay: bool) -> tuple[int, Path, int | None]:
    """A forked process creates a staging directory for ``target``, then exits (``stay=False``, reaped here) or waits
    until the returned descriptor is closed. Returns its pid, the directory and that descriptor."""
    names_read, names_write = os.pipe()
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(hold_write)
        os.write(names_write, os.fsencode(publish.make_staging_directory(target)))
        if stay:
            os.read(hold_read, 1)  # until the parent closes its end
        os._exit(0)
    os.close(names_write)
    staging = Path(os.fsdecode(os.read(names_read, 4096)))
    os.close(names_read)
    os.close(hold_read)
    if not stay:
        os.close(hold_write)
        os.waitpid(pid, 0)
        return pid, staging, None
    return pid, staging, hold_write


def test_a_staging_directory_is_reclaimed_only_once_its_saver_is_dead(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint"
    target.mkdir()
    alive_pid, alive, hold = make_staging_in_child(target, stay=True)
    _, dead, _ = make_staging_in_child(target, stay=False)
    mine = publish.make_staging_directory(target)
    assert dead.name.endswith(f"-{socket.gethostname()}")  # its saver's host
    elsewhere = shutil.copytree(dead, tmp_path / dead.name.replace(socket.gethostname(), "another-host"))
    legacy = tmp_path / ".checkpoint.partial-0123456789abcdef"  # an earlier release's name records no saver
    legacy.mkdir()
    assert mine.is_dir()
    publish.reclaim(target)  # this process's own staging directory is a failed save's: it saves one at a time
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint", alive.name, Path(elsewhere).name])
    assert hold is not None
    os.close(hold)
    os.waitpid(alive_pid, 0)
    publish.reclaim(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint", Path(elsewhere).name])
