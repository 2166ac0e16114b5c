"""The process group of a run that offloads from CUDA: host tensors need a CPU backend beside NCCL."""

from __future__ import annotations

import torch


def backend_with_host(requested: str | None) -> str:
    """The process-group backend of a run offloading from CUDA: some collectives carry host tensors (clipping norms,
    the fp16 overflow vote), which gloo takes while NCCL takes the device ones."""
    if requested is None:
        return "cpu:gloo,cuda:nccl"
    if "gloo" not in requested:
        raise ValueError(
            f"Offloading keeps optimizer state on the host, whose collectives need a CPU backend, but"
            f" `process_group_backend={requested!r}`. HINT: pass 'cpu:gloo,cuda:nccl' or leave it unset."
        )
    return requested


def check_host_collectives() -> None:
    """Offloaded state needs collectives on host tensors; a process group made earlier in this process (by another
    strategy's run) may lack a CPU backend."""
    try:
        torch.distributed.group.WORLD._get_backend(torch.device("cpu"))
    except RuntimeError as error:
        raise RuntimeError(
            "Offloading keeps optimizer state on the host, but this process's process group, created before this run,"
            " has no CPU backend. HINT: call `torch.distributed.destroy_process_group()` before this `fit`, or start"
            " it in a fresh process; the strategy then creates one with 'cpu:gloo,cuda:nccl'."
        ) from error
