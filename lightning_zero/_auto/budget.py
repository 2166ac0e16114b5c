"""The bytes one rank may fill, read at set-up: on the CPU the tightest memory group's room or the machine's
available memory, shared by the node's ranks; on a GPU the device's free memory, and host memory beside it.

What the rank already holds of the model (its parameters, built before the choice) counts as room: the model state
the choice places includes them."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lightning_zero._offload.cgroup import limiting_group
from lightning_zero.estimate import format_bytes

_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Budget:
    """One rank's room, in bytes."""

    memory: int  # where the computation runs: the device's free memory, or on the CPU the host's
    host: int | None  # host memory beside a GPU; ``None`` on the CPU, where ``memory`` is the host's
    disk: int | None  # this rank's share of the free space under ``offload_dir``; ``None``: files are not weighed
    source: str  # how ``memory`` was found, for the table

    def tightest(self, other: Budget) -> Budget:
        """The least of two ranks' budgets, field by field (``source`` that of the lesser memory)."""
        least = self if self.memory <= other.memory else other
        return replace(
            least,
            host=_least(self.host, other.host),
            disk=_least(self.disk, other.disk),
        )


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def host_room(local_ranks: int, held: int) -> tuple[int, str]:
    """This rank's share of the host memory the node's ranks may still fill, plus ``held`` (bytes of the model it
    holds there already): the least of the limiting memory group's limit less its anonymous and dirty memory (its
    clean page cache can be reclaimed) and the kernel's ``MemAvailable``."""
    rooms = []
    group = limiting_group()
    if group is not None:
        usage = group.usage()
        rooms.append((group.limit - usage.anonymous - usage.dirty, f"memory group limit {format_bytes(group.limit)}"))
    available = _mem_available()
    if available is not None:
        rooms.append((available, "available memory"))
    if not rooms:
        raise RuntimeError(
            "zero_auto could not read this machine's memory (no memory group limit, no /proc/meminfo)."
            " HINT: pass `memory_per_rank` with the bytes each rank may use."
        )
    room, source = min(rooms)
    return max(room, 0) // local_ranks + held, f"{source}, over {local_ranks} rank(s) of this node"


def device_room(device: torch.device, held: int) -> tuple[int, str]:
    """The device's free memory plus ``held`` (bytes of the model already on it)."""
    free, total = torch.cuda.mem_get_info(device)
    return free + held, f"free memory of {device} ({format_bytes(total)} in all)"


def disk_room(directory: Path, local_ranks: int) -> int:
    """This rank's share of the free space of the filesystem holding ``directory`` (or its nearest existing
    parent)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free // local_ranks


def _mem_available() -> int | None:
    try:
        lines = _MEMINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
