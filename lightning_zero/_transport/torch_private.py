"""The private parts of torch this package relies on, in one place: each import says what it is for and what happens
when a torch release moves it.

- ``fully_shard``'s pluggable collectives (:class:`AllGather`, :class:`ReduceScatter`), which
  :mod:`.fsdp_comms` implements on CPU process groups; on a torch without them ``fully_shard`` keeps its own
  collectives (:data:`CUSTOM_COLLECTIVES` is false) and training still runs, only slower on gloo (and reducing by
  sum, since gloo's reduce-scatter there sums where it is asked to average). There, the module-level names through
  which a unit's parameter group calls its own all-gather and reduce-scatter (:func:`before_own_collectives`) let
  the ranks meet, labelled, before each.
- ``_sync_module_states``, the broadcast of rank 0's parameters and buffers that DDP and FSDP start from.
- a ``fully_shard`` root's state (:func:`has_run_forward`): whether its lazy set-up, at the first forward, happened.
- a ``fully_shard`` unit's training state and parameter group (:func:`gather_for_recompute`), to gather units that
  activation checkpointing recomputes in backward where torch does not (torch 2.8).
- a ``fully_shard`` unit's parameters as it keeps them (:func:`unit_shards`, :func:`move_shard`, :func:`shard_grad`,
  :func:`settle_shards`): the padded copy of each shard that it gathers from, which parameters offloaded to disk
  replace with memory-mapped files (once its lazy set-up's re-padding is done), and the DTensor form of a gradient
  shard.
- a DTensor's layout given to a new local tensor on that tensor's own device (:func:`dtensor_like`): the public
  ``DTensor.from_local`` moves the tensor to its mesh's device type, and ``fully_shard`` keeps host-offloaded shards
  (and so their optimizer state) as host tensors on a CUDA mesh.
- a ``fully_shard`` root's reset after an aborted step (:func:`reset_after_failure`): ``reset_iter_state`` in recent
  torch; a torch without it gets every unit resharded by hand.
- a ``DeviceMesh``'s own references to its process groups (:func:`release_mesh_groups`); a torch whose meshes hold
  none has nothing to release.
- the default process group's store (:func:`default_store`), where ranks tell each other why they failed; a torch
  that does not expose it gets ``None``, and errors then do not name the other ranks' causes.
- the process groups that exist (:func:`process_groups`), whose collectives the stall watchdog releases; a torch that
  keeps no such map gives the default group alone.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup, Store
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor
from torch.distributed.utils import _sync_module_states as sync_module_states

try:  # the interface of `fully_shard`'s pluggable collectives (recent torch)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    CUSTOM_COLLECTIVES = True
except ImportError:  # older torch: `fully_shard` keeps its own collectives
    AllGather = ReduceScatter = object  # type: ignore[assignment, misc]
    CUSTOM_COLLECTIVES = False


# FSDPParam -> (called before its unit's all-gather, before its unit's reduce-scatter), where torch keeps its own
_BEFORE_OWN: weakref.WeakKeyDictionary[Any, tuple[Callable[[], None], Callable[[], None]]] = weakref.WeakKeyDictionary()


def before_own_collectives(unit: FSDPModule, gather: Callable[[], None], reduce: Callable[[], None]) -> None:
    """On a torch whose ``fully_shard`` keeps its own collectives: call ``gather`` just before each all-gather of
    ``unit``'s parameters and ``reduce`` just before each reduce-scatter of its gradients, on the thread that starts
    them (the calls its parameter group makes through ``foreach_all_gather`` and ``foreach_reduce``)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    if not hasattr(param_group.foreach_all_gather, "_lightning_zero"):
        param_group.foreach_all_gather = _calling_first(param_group.foreach_all_gather, 0)
        param_group.foreach_reduce = _calling_first(param_group.foreach_reduce, 1)
    for shard in unit_shards(unit):
        _BEFORE_OWN[shard] = (gather, reduce)


def _calling_first(collective: Callable[..., Any], which: int) -> Callable[..., Any]:
    """``collective`` (its first argument: the unit's ``FSDPParam`` list), after the ``which`` callback registered
    for that unit, if one is."""

    def call(shards: list[Any], *args: Any, **kwargs: Any) -> Any:
        before = _BEFORE_OWN.get(shards[0]) if shards else None
        if before is not None:
            before[which]()
        return collective(shards, *args, **kwargs)

    call._lightning_zero = True  # type: ignore[attr-defined]
    return call


def has_run_forward(root: FSDPModule) -> bool:
    """Whether the ``fully_shard`` root ran a forward: it sets up its per-step state (which a reset walks) only then,
    and marks it by deciding that it is the root (``None`` until then)."""
    return root._get_fsdp_state()._is_root is not None


def gather_for_recompute(module: nn.Module) -> None:
    """Before activation checkpointing runs ``module``'s forward again in backward: all-gather each unit inside it
    whose backward has begun (``PRE_BACKWARD``) and whose parameters a backward already freed (a unit called twice in
    one step). ``fully_shard`` leaves the gather in that state to its pre-backward hook; torch 2.13 gathers such a unit
    again itself, torch 2.8 runs the recomputation on the shards, which fails (``got mixed torch.Tensor and DTensor``).
    Anywhere else (a first forward, a unit that is gathered or not in backward yet) this changes nothing."""
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        if unit._get_fsdp_state()._training_state is not TrainingState.PRE_BACKWARD:
            continue
        for group in _param_groups(unit):
            if not group.is_unsharded:
                group.unshard()
                group.wait_for_unshard()


def unit_shards(unit: FSDPModule) -> list[Any]:
    """The ``FSDPParam`` of each parameter ``unit`` gathers (not those of units inside it), as its lazy set-up (at
    the root's first forward) left them."""
    return [shard for group in _param_groups(unit) for shard in group.fsdp_params]


def _param_groups(unit: FSDPModule) -> list[Any]:
    """``unit``'s parameter groups: several in recent torch, one (or none) in torch 2.8."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    return [group for group in groups if group is not None]


def registered(shard: Any) -> bool:
    """Whether ``shard``'s parameter is still the one its module registers (nothing replaced it since
    :func:`settle_shards`)."""
    module, name = shard_owner(shard)
    return getattr(module, name) is shard.sharded_param


def settle_shards(unit: FSDPModule) -> None:
    """Do now, to ``unit``'s shards (their values given), what ``fully_shard``'s lazy set-up at the root's first
    forward would: take up a parameter replaced since sharding and re-pad each shard into the flat copy it gathers
    from. The set-up then leaves them alone (it does this once per parameter group), so that storage given to them
    afterwards (:func:`move_shard`) stays theirs; torch 2.8 would otherwise copy an unevenly sharded one into new
    memory there."""
    for group in _param_groups(unit):
        if not group._reset_sharded_params:
            for shard in group.fsdp_params:
                shard.reset_sharded_param()
                shard._init_extensions()
            group._reset_sharded_params = True


def shard_owner(shard: Any) -> tuple[nn.Module, str]:
    """The module that registers ``shard``'s parameter (the first, for one shared by several), and its name there."""
    return shard._module_info.module, shard._module_info.param_name


def padded_shard(shard: Any) -> torch.Tensor:
    """The flat, padded copy of this rank's rows that ``fully_shard`` gathers from."""
    return shard._sharded_param_data


def move_shard(shard: Any, padded: torch.Tensor) -> None:
    """Make ``padded`` (flat, as :func:`padded_shard`, holding its values) the storage of ``shard``: what
    ``fully_shard`` gathers from, and the parameter's local tensor (its first rows), as ``reset_sharded_param`` does
    for a replaced parameter; the parameter object, which the optimizer holds, stays."""
    local = shard.sharded_param._local_tensor
    rows = local.size(0) if local.numel() > 0 else 0
    shaped = padded.view(shard.padded_sharded_param_size)
    shard._sharded_param_data = padded
    shard.sharded_param._local_tensor = shaped.narrow(0, 0, rows)


def shard_grad(shard: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` (of the shard's unpadded shape) as the DTensor ``fully_shard`` gives a gradient shard."""
    return shard.to_sharded_dtensor(local)


def dtensor_like(like: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` (of ``like``'s local shape and dtype) as the local tensor of a DTensor laid out as ``like``, left on
    its own device."""
    return DTensor(local, like._spec, requires_grad=False)


def reset_after_failure(root: FSDPModule) -> None:
    """After an exception aborted a step of ``root`` (a ``fully_shard`` root that ran a forward): reshard every unit,
    the root included. torch 2.13's ``reset_iter_state`` does, and drops the step's unfinished gathers and gradient
    reductions as well; torch 2.8 has none, and every unit is resharded here (the root reshards only when told to
    reshard after forward, which it is not by default)."""
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
        return
    root.set_reshard_after_forward(True)
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    root.set_reshard_after_forward(False, recurse=False)


def release_mesh_groups() -> None:
    """Make every live ``DeviceMesh`` drop its references to its process groups (``_pg_registry``, in recent torch
    releases). DTensor's caches (sharding propagation, redistribution plans, mesh topology) keep meshes for the life of
    the process, and with them the groups, which ``destroy_process_group`` then cannot destroy. For the end of the
    process only: a mesh without them cannot be compiled through."""
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh):  # not isinstance: it would read `__class__`, which some objects warn on
            getattr(obj, "_pg_registry", {}).clear()


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


__all__ = [
    "CUSTOM_COLLECTIVES",
    "AllGather",
    "ReduceScatter",
    "before_own_collectives",
    "default_store",
    "gather_for_recompute",
    "has_run_forward",
    "move_shard",
    "padded_shard",
    "process_groups",
    "registered",
    "release_mesh_groups",
    "reset_after_failure",
    "settle_shards",
    "shard_grad",
    "shard_owner",
    "sync_module_states",
    "unit_shards",
]
