"""Closing the package's communication before the interpreter exits, and before it forks.

A gloo process group runs its collectives on threads of its own, joined only when the group itself is destroyed,
which ``destroy_process_group`` does not do while anything still refers to the group. Such a thread that finishes a
collective drops the work's tensors, which takes the GIL; if the interpreter is finalizing by then, Python ends the
thread in the middle of a C++ destructor, and the process aborts ("terminate called without an active exception").
So the hook lets go of every reference the package and torch's device meshes keep to the groups, and collects, so
that the groups are destroyed and their threads joined while the interpreter is whole.

A forked process inherits its parent's objects but not its threads: if it dropped the last reference to a group of the
parent's (a mesh of a run that ended, still cached), destroying the group would wait for threads that do not exist
there, forever. So before a fork the parent lets go of the groups of runs that ended itself.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

import torch.distributed as dist

from lightning_zero._core import run_scope
from lightning_zero._transport import launched, mesh, shared_memory
from lightning_zero._transport.c10d_private import release_mesh_groups
from lightning_zero._transport.traffic import TRAFFIC
from lightning_zero._watchdog import watchdog


@atexit.register
def _close_process_group() -> None:
    """Lightning leaves the process group open after training: close it, then release the groups (see the module);
    then wait for the ranks this process started, if it did (:mod:`lightning_zero._transport.launched`)."""
    failed = getattr(sys, "last_value", None) is not None  # an uncaught exception ends this process
    _drop_last_exception()
    # a rank that ends normally waits for its peers' ends: one still blocked in a collective it will never enter, or
    # stopped, fails this one too (the watchdog's verdict, printed), within `stall_after`
    stalled = watchdog.at_exit(failed) is not None and not failed
    run_scope.end_current()  # a Fabric run ends here at the latest
    watchdog.stop()
    shared_memory.close_all(failed or stalled)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _release_groups()
    launched.wait_for_started_ranks(failing=failed or stalled)
    if stalled:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # as in `launched`: an exit hook cannot change the status otherwise


def _drop_last_exception() -> None:
    """After an uncaught exception, the interpreter keeps its traceback (already printed) to the very end, and with it
    every object the failed frames held (the module, the strategy, sharded tensors): drop it, so that they go as they
    do after a run that ends without an error."""
    for name in ("last_exc", "last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            setattr(sys, name, None)


def _release_groups() -> None:
    """Let go of the references to the process groups that outlive a run: the package's meshes and traffic
    placements, and the device meshes' own (torch keeps meshes in its caches); then collect the cycles that hold the
    rest (a module's engine, its sharded tensors), which destroys the groups and joins their threads."""
    mesh.forget_meshes()
    TRAFFIC.forget_groups()
    release_mesh_groups(mesh.created_meshes())
    gc.collect()


def _before_fork() -> None:
    """In the parent, before it forks (a Trainer's ``start_method="fork"`` after a run in a notebook): release the
    groups of runs that ended, here, where their threads run. Nothing to do (and no collection) when none ended."""
    if not mesh.forget_stale_meshes():
        return
    TRAFFIC.forget_groups()
    if not (dist.is_available() and dist.is_initialized()):  # no run goes on: every mesh left is an ended run's
        release_mesh_groups(mesh.created_meshes())
    gc.collect()


os.register_at_fork(before=_before_fork)
