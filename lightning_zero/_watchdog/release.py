"""Making the collective this process's main thread is blocked in fail, once a verdict is reached, so that the error
leaves through the front end's teardown instead of waiting the process group's timeout.

Every process group of the process is released, each backend it holds by its own means:

- *gloo* (a ``gloo`` group, or the CPU side of a ``cpu:gloo,cuda:nccl`` group, which offloading on GPUs uses): this
  process's connection to each peer is closed, by a receive posted to that peer and abandoned after a millisecond (a
  tag no collective of torch's uses): a blocked gloo collective then fails at once ("Connection closed by peer").
  ``abort()`` does not reach it: it leaves a blocked gloo collective waiting (measured on torch 2.13);
- *NCCL*: its communicator is aborted, after the gloo side of the same group was closed (aborting first would leave a
  gloo call blocked);
- any other backend is left alone.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_zero._transport.c10d_private import abort_backend, backends, process_groups

_FOREIGN_TAG = 0x5A0DD06  # the tag of the receive that closes a gloo connection: no collective of torch's uses it


def release() -> None:
    """Make the collective this process's main thread is blocked in fail (see the module)."""
    for group in process_groups():
        by_device = backends(group)
        if "gloo" in by_device.values():
            close_connections(group)
        for device, backend in by_device.items():
            if backend == "nccl":
                with contextlib.suppress(Exception):  # aborted already, or never initialized
                    abort_backend(group, device)


def close_connections(group: ProcessGroup) -> None:
    """Close this process's gloo connection to each peer of ``group``."""
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(group):
        if peer == me:
            continue
        with contextlib.suppress(Exception):  # closed already
            work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_FOREIGN_TAG)
            work.wait(timeout=timedelta(milliseconds=1))
