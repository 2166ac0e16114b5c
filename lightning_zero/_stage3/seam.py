"""The seam between stage 3 and the private parts of torch's ``fully_shard`` it relies on: nothing else in the package
names a private attribute or module of ``fully_shard`` (or of DTensor), and each thing used is a contract item below,
checked on the real objects as stage 3 sets up (:func:`check_contract`), so that a torch whose internals differ fails
there, with an error naming the item, never at step 100. (Torch's process groups have a seam of their own, below
every room: :mod:`lightning_zero._transport.c10d_private`.)

The contract, item by item (:data:`CONTRACT` checks each; ``tests/test_seam.py`` exercises each on every torch CI
runs):

- **unit state**: a ``fully_shard`` unit's state says whether the root's lazy set-up ran (:func:`has_run_forward`)
  and where a unit is in its step (:func:`gather_for_recompute`, to gather units that activation checkpointing
  recomputes in backward where torch 2.8 does not).
- **parameter groups**: a unit's parameter group(s) (several in recent torch, one in 2.8) and their ``FSDPParam``
  shards (:func:`unit_shards`), which gather and reshard on request.
- **shard storage**: the padded copy of each shard that a unit gathers from (:func:`padded_shard`), replaced by
  memory-mapped files under ``offload_parameters="disk"`` (:func:`move_shard`, once the lazy set-up's re-padding is
  done: :func:`settle_shards`); the parameter a shard registers, and where (:func:`sharded_param`,
  :func:`shard_owner`, :func:`registered`).
- **gradient shard**: the DTensor form of a gradient shard (:func:`shard_grad`).
- **row split**: a parameter's rows on each rank (:func:`my_rows`), as ``fully_shard`` splits dim 0.
- **own collectives**: on a torch whose ``fully_shard`` has no pluggable collectives (:data:`CUSTOM_COLLECTIVES` is
  false: 2.8), the module-level names through which a parameter group calls its all-gather and reduce-scatter,
  rebound while a unit has arounds (:func:`around_own_collectives`; :func:`forget_own_collectives`, or the last such
  unit going away, restores them); where it has them, the interface of ``fully_shard``'s pluggable collectives
  (:class:`AllGather`, :class:`ReduceScatter`), which :mod:`.collectives` implements on CPU process groups.
- **stream keepalives**: what a unit's gathers and reductions keep alive for a CUDA stream to wait on, the last
  all-gather's output and the reduce-scatter inputs in flight (:func:`release_stream_keepalives`), freed at once on
  the CPU, where nothing waits on a stream.
- **reset**: a root's reset after an aborted step (:func:`reset_after_failure`): ``reset_iter_state`` in recent
  torch, every unit resharded by hand in 2.8.
- **secondary copy**: the groups a unit reshards to after its forward where ``reshard_after_forward`` is a group size
  (ZeRO++'s secondary partition): one set of groups given to every unit (:func:`secondary_groups`), where
  ``fully_shard`` would make new ones for each unit; each unit's parameter groups then gather over them in backward.
- **DTensor layout**: a DTensor's own local tensor (:func:`local_tensor`, what an optimizer steps on), and its layout
  given to a new local tensor on that tensor's own device (:func:`dtensor_like`): the public ``DTensor.from_local``
  moves the tensor to its mesh's device type, and ``fully_shard`` keeps host-offloaded shards (and so their optimizer
  state) as host tensors on a CUDA mesh.

Beyond the contract, checked where used: the checkpoint wrapper class activation checkpointing puts around a unit
(:data:`CheckpointWrapper`).

The module imports torch alone: the offload room's shards in files (:mod:`lightning_zero._offload.param_files`), below
stage 3, use it too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fully_shard as _fully_shard_module
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, TrainingState
from torch.distributed.tensor import DTensor

try:  # the interface of `fully_shard`'s pluggable collectives (recent torch)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    CUSTOM_COLLECTIVES = True
except ImportError:  # older torch: `fully_shard` keeps its own collectives
    AllGather = ReduceScatter = object  # type: ignore[assignment, misc]
    CUSTOM_COLLECTIVES = False


Around = Callable[[Callable[[], Any]], Any]
"""Runs the collective it is given (``fully_shard``'s own all-gather or reduce-scatter of one unit) and returns its
result: what the package does around it (a label recorded before it, an error turned into the stall watchdog's
verdict after it)."""

# id(FSDPParam) -> (a weak reference to it, its unit's (gather, reduce) arounds), where torch keeps its own
# collectives; an entry goes with its shard, and once none is left the names below are restored
_AROUND_OWN: dict[int, tuple[weakref.ref[Any], tuple[Around, Around]]] = {}
# the module-level names of `fully_shard`'s parameter group that :func:`around_own_collectives` rebinds, and what they
# were bound to before; empty while nothing is rebound
_OWN_COLLECTIVES = ("foreach_all_gather", "foreach_reduce")
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def around_own_collectives(unit: FSDPModule, gather: Around, reduce: Around) -> None:
    """On a torch whose ``fully_shard`` keeps its own collectives: run each all-gather of ``unit``'s parameters through
    ``gather`` and each reduce-scatter of its gradients through ``reduce``, on the thread that starts them (the calls
    its parameter group makes through ``foreach_all_gather`` and ``foreach_reduce``, rebound here while any unit has
    arounds: :func:`forget_own_collectives`, or the last such unit going away, restores them)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    if not _ORIGINALS:
        for which, name in enumerate(_OWN_COLLECTIVES):
            _ORIGINALS[name] = getattr(param_group, name)
            setattr(param_group, name, _run_through(_ORIGINALS[name], which))
    for shard in unit_shards(unit):
        _AROUND_OWN[id(shard)] = (weakref.ref(shard, _shard_gone), (gather, reduce))


def own_collective_arounds(unit: FSDPModule) -> tuple[Around, Around] | None:
    """The arounds :func:`around_own_collectives` gave ``unit``, if it has any."""
    shards = unit_shards(unit)
    return _arounds_of(shards[0]) if shards else None


def forget_own_collectives(unit: FSDPModule) -> None:
    """Drop ``unit``'s arounds; once no unit has any, ``fully_shard``'s module-level names are what they were."""
    for shard in unit_shards(unit):
        _AROUND_OWN.pop(id(shard), None)
    _restore_if_unused()


def _arounds_of(shard: Any) -> tuple[Around, Around] | None:
    entry = _AROUND_OWN.get(id(shard))
    return entry[1] if entry is not None and entry[0]() is shard else None


def _shard_gone(ref: weakref.ref[Any]) -> None:
    """A shard with arounds was freed (its module dropped without a teardown: Fabric has none)."""
    for key, (held, _) in list(_AROUND_OWN.items()):
        if held is ref:
            del _AROUND_OWN[key]
    _restore_if_unused()


def _restore_if_unused() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    if not _AROUND_OWN and _ORIGINALS:
        for name in _OWN_COLLECTIVES:
            setattr(param_group, name, _ORIGINALS.pop(name))


def _run_through(collective: Callable[..., Any], which: int) -> Callable[..., Any]:
    """``collective`` (its first argument: the unit's ``FSDPParam`` list), run through the ``which`` around
    registered for that unit, if one is."""

    def call(shards: list[Any], *args: Any, **kwargs: Any) -> Any:
        arounds = _arounds_of(shards[0]) if shards else None
        if arounds is None:
            return collective(shards, *args, **kwargs)
        return arounds[which](lambda: collective(shards, *args, **kwargs))

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


def release_stream_keepalives(unit: FSDPModule) -> None:
    """Free what ``fully_shard`` keeps alive for a CUDA stream to wait on: the output of the last all-gather in
    forward (until the next one is copied out) and the inputs of the reduce-scatters in flight (until the next unit's
    reduction); a unit's size each. Only where no stream runs (the CPU): a CUDA stream may still read them."""
    context = unit._get_fsdp_state()._comm_ctx
    context.all_gather_state = None
    if hasattr(context, "reduce_scatter_states"):  # recent torch: a list of them
        context.reduce_scatter_states.clear()
    else:  # torch 2.8: one
        context.reduce_scatter_state = None


def sharded_param(shard: Any) -> nn.Parameter:
    """The parameter (a DTensor of this rank's rows) that ``shard`` registers in its module."""
    return shard.sharded_param


def my_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """``rank``'s rows of ``full`` as ``fully_shard`` splits dim 0 over ``world_size`` ranks: ``torch.chunk``'s
    pieces (ceil(rows / world_size) each, the last ones shorter or empty)."""
    if full.dim() == 0:
        return full
    pieces = torch.chunk(full, world_size, dim=0)
    return pieces[rank] if rank < len(pieces) else full.narrow(0, full.size(0), 0)


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


def mark_sharded(root: nn.Module) -> None:
    """Mark ``root`` and its submodules the way ``fully_shard`` marks the modules it manages: Hugging Face's
    ``generate`` then turns ``synced_gpus`` on by itself (every rank keeps running forwards until all are done, which
    stage 3's gathers need), and ``torch.compile`` treats their parameters as inputs (they change between forwards)."""
    for module in root.modules():
        module._is_fsdp_managed_module = True  # type: ignore[assignment]


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """The tensor holding this rank's part of ``dtensor``, itself: ``to_local`` gives a parameter a new view of it
    at every call in recent torch, and the identity of this one says whether the storage was replaced since."""
    return dtensor._local_tensor


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


@contextmanager
def secondary_groups(
    inner: ProcessGroup, across: ProcessGroup, ranks: list[list[int]], device_type: str
) -> Generator[int, None, None]:
    """While open, ``fully_shard(..., reshard_after_forward=size)`` (``size``: what it yields) makes its unit reshard
    after forward to ``inner`` (this rank's part of the shard group, a row of ``ranks``) rather than to new groups of
    its own; ``across`` links each part's counterparts (a column of ``ranks``)."""
    original = getattr(_fully_shard_module, "_get_post_forward_mesh_info", None)
    if original is None:
        raise TorchContractError(
            f"torch {torch.__version__}'s `fully_shard` does not provide what lightning_zero's stage 3 relies on for"
            " the contract item 'secondary copy'. HINT: use a torch release within the range lightning_zero"
            " declares, or drop `secondary_group_size`."
        )
    mesh = DeviceMesh.from_group([across, inner], device_type, mesh=ranks, mesh_dim_names=("parts", "part"))
    info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)

    def shared(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool):
            return original(reshard_after_forward, mesh_info)
        return info

    _fully_shard_module._get_post_forward_mesh_info = shared
    try:
        yield inner.size()
    finally:
        _fully_shard_module._get_post_forward_mesh_info = original


def _secondary_holds(unit: FSDPModule) -> bool:
    groups = _param_groups(unit)
    made_here = hasattr(_fully_shard_module, "_get_post_forward_mesh_info")  # what `secondary_groups` replaces
    return made_here and all(hasattr(group, "post_forward_mesh_info") for group in groups)


class TorchContractError(RuntimeError):
    """The installed torch lacks something of ``fully_shard`` (or DTensor) this package relies on."""


@dataclass(frozen=True)
class ContractItem:
    """One thing of torch's private state the package relies on, checked on the units ``fully_shard`` just sharded."""

    name: str
    what: str  # what the package uses it for
    holds: Callable[[FSDPModule], bool]  # on one unit


def _has(obj: Any, *names: str) -> bool:
    return all(hasattr(obj, name) for name in names)


def _state_holds(unit: FSDPModule) -> bool:
    return _has(unit, "_get_fsdp_state") and _has(unit._get_fsdp_state(), "_is_root", "_training_state")


def _groups_hold(unit: FSDPModule) -> bool:
    """Its groups have what the package uses, and hold a shard of each parameter the unit manages (those of its
    modules that no unit inside it manages)."""
    groups = _param_groups(unit)
    if not all(_has(g, "fsdp_params", "_reset_sharded_params", "unshard", "wait_for_unshard", "is_unsharded") for g in
               groups):  # fmt: skip
        return False
    own = {id(p) for m in _managed_modules(unit) for p in m.parameters(recurse=False) if isinstance(p, DTensor)}
    return own == {id(shard.sharded_param) for shard in unit_shards(unit)}


def _managed_modules(unit: FSDPModule) -> list[nn.Module]:
    """``unit`` and its modules down to, not into, the units inside it."""
    found, todo = [], [unit]
    while todo:
        module = todo.pop()
        found.append(module)
        todo.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return found


def _storage_holds(unit: FSDPModule) -> bool:
    return all(
        _has(shard, "_sharded_param_data", "sharded_param", "padded_sharded_param_size", "reset_sharded_param")
        and _has(shard, "_init_extensions", "_module_info", "to_sharded_dtensor")
        and _has(shard._module_info, "module", "param_name")
        and _has(shard.sharded_param, "_local_tensor")
        for shard in unit_shards(unit)
    )


def _rows_hold(unit: FSDPModule) -> bool:
    def holds(param: DTensor) -> bool:
        mesh = param.device_mesh
        full = torch.empty(param.shape, device="meta")
        return my_rows(full, mesh.get_local_rank(), mesh.size()).shape == param.to_local().shape

    return all(holds(shard.sharded_param) for shard in unit_shards(unit))


def _layout_holds(unit: FSDPModule) -> bool:
    def holds(param: DTensor) -> bool:
        moved = dtensor_like(param, torch.empty_like(param.to_local()))
        return moved.placements == param.placements and moved.shape == param.shape and _has(param, "_local_tensor")

    return all(holds(shard.sharded_param) for shard in unit_shards(unit))


def _keepalives_hold(unit: FSDPModule) -> bool:
    """The shared context of a unit's collectives keeps them (set by its lazy set-up, at the root's first forward)."""
    context = unit._get_fsdp_state()._comm_ctx
    kept = set(type(context).lazy_init.__code__.co_names) | set(vars(context)) | set(vars(type(context)))
    return "all_gather_state" in kept and bool(kept & {"reduce_scatter_states", "reduce_scatter_state"})


def _own_collectives_hold(unit: FSDPModule) -> bool:
    if CUSTOM_COLLECTIVES:
        return _has(unit, "set_custom_all_gather", "set_custom_reduce_scatter")
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    return _has(param_group, *_OWN_COLLECTIVES)


CONTRACT = (
    ContractItem("unit state", "whether the root's set-up ran; where a unit is in its step", _state_holds),
    ContractItem("parameter groups", "a unit's groups and their shards, gathered on request", _groups_hold),
    ContractItem("shard storage", "the padded shard a unit gathers from, replaced by files on disk; a gradient"
                 " shard as a DTensor", _storage_holds),
    ContractItem("row split", "each rank's rows of a parameter built after sharding", _rows_hold),
    ContractItem("own collectives", "labels before each gather and reduction of a unit", _own_collectives_hold),
    ContractItem("stream keepalives", "a unit's gather and reduction buffers freed at once on the CPU",
                 _keepalives_hold),
    ContractItem("reset", "a root at rest after an aborted step", lambda u: _has(u, "set_reshard_after_forward")),
    ContractItem("DTensor layout", "steps on local tensors, state in files laid out", _layout_holds),
    ContractItem("secondary copy", "units resharded after forward to one set of groups", _secondary_holds),
)  # fmt: skip


def check_contract(units: list[FSDPModule]) -> None:
    """Check every :data:`CONTRACT` item on each of ``units`` (those ``fully_shard`` just sharded); raise
    :class:`TorchContractError` naming the first that does not hold."""
    for item in CONTRACT:
        for unit in units:
            try:
                holds = item.holds(unit)
            except (AttributeError, IndexError, TypeError, RuntimeError):
                holds = False
            if not holds:
                raise TorchContractError(
                    f"torch {torch.__version__}'s `fully_shard` does not provide what lightning_zero's stage 3 relies"
                    f" on for the contract item {item.name!r} ({item.what}). HINT: use a torch release within the"
                    " range lightning_zero declares (`pip install lightning-zero` picks one); `docs/how-it-works.md`"
                    " ('The seam over fully_shard') says what each release provides."
                )


__all__ = [
    "CONTRACT",
    "CUSTOM_COLLECTIVES",
    "AllGather",
    "CheckpointWrapper",
    "ReduceScatter",
    "TorchContractError",
    "around_own_collectives",
    "check_contract",
    "dtensor_like",
    "forget_own_collectives",
    "gather_for_recompute",
    "has_run_forward",
    "move_shard",
    "my_rows",
    "own_collective_arounds",
    "padded_shard",
    "registered",
    "reset_after_failure",
    "secondary_groups",
    "settle_shards",
    "shard_grad",
    "shard_owner",
    "sharded_param",
    "unit_shards",
]
