"""The private parts of torch's process groups (c10d) the package relies on, each used where it is named, so that a
torch whose internals differ changes this file alone: the default process group's store (:func:`default_store`, where
ranks tell each other why they failed and the stall watchdog asks its rounds; without it ``None``, and errors then do
not name the other ranks' causes), the process groups that exist (:func:`process_groups`, whose collectives the stall
watchdog releases; a torch that keeps no such map gives the default group alone), each group's backend per device
(:func:`backends`), a ``DeviceMesh``'s own references to its process groups (:func:`release_mesh_groups`; a torch whose
meshes hold none has nothing to release) and ``_sync_module_states``, the broadcast of rank 0's parameters and buffers
that DDP and FSDP start from.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch.distributed import ProcessGroup, Store
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.utils import _sync_module_states as sync_module_states


def default_store() -> Store | None:
    """The key-value store of the default process group (the rendezvous' TCP store), or None outside a group."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    try:
        return get()
    except (RuntimeError, ValueError):
        return None


def process_groups() -> list[ProcessGroup]:
    """Every process group of this process that c10d keeps (the default one first)."""
    if not dist.is_initialized():
        return []
    world = dist.group.WORLD
    known = getattr(dist.distributed_c10d, "_world", None)
    others = list(getattr(known, "pg_map", {}).keys())
    return [world, *(group for group in others if group is not world)]


def backends(group: ProcessGroup) -> dict[str, str]:
    """``group``'s backend for each device type (``{"cpu": "gloo", "cuda": "nccl"}`` for a ``cpu:gloo,cuda:nccl``
    group; a plain ``"gloo"`` group serves both); empty where the group is gone."""
    try:
        config = dist.get_backend_config(group)
    except (RuntimeError, ValueError, AttributeError):
        return {}
    pairs = [entry.split(":", 1) for entry in config.split(",")]
    return {device: backend for device, backend in pairs} if all(len(p) == 2 for p in pairs) else {"cpu": config}


def abort_backend(group: ProcessGroup, device: str) -> None:
    """Abort ``group``'s backend for ``device`` alone (NCCL's communicator), leaving its others; the whole group where
    a torch cannot tell them apart."""
    import torch

    get = getattr(group, "_get_backend", None)
    backend = get(torch.device(device)) if get is not None else group
    backend.abort()


def release_mesh_groups(meshes: Iterable[DeviceMesh]) -> None:
    """Make ``meshes`` (those this package created) drop their references to their process groups (``_pg_registry``,
    in recent torch releases, shared with the meshes sliced from them). DTensor's caches (sharding propagation,
    redistribution plans, mesh topology) keep meshes for the life of the process, and with them the groups, which
    ``destroy_process_group`` then cannot destroy. For the end of a run only: a mesh without them cannot be compiled
    through."""
    for mesh in meshes:
        getattr(mesh, "_pg_registry", {}).clear()


__all__ = ["abort_backend", "backends", "default_store", "process_groups", "release_mesh_groups", "sync_module_states"]
