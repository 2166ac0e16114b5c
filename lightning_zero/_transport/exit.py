"""Closing the package's communication before the interpreter exits."""

from __future__ import annotations

import atexit

import torch.distributed as dist

from lightning_zero._transport import shared_memory


@atexit.register
def _close_process_group() -> None:
    """Lightning leaves the process group open after training; torn down only by interpreter exit, gloo's worker
    threads can be destroyed still joinable ("terminate called without an active exception"). Close it first."""
    shared_memory.close_all()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
