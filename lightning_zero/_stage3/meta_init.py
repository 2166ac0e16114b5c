"""Stage 3 for models too large for one rank: parameters built without memory, given their values shard by shard.

Under :class:`MetaInit` (the strategy enters it in ``tensor_init_context`` and ``model_sharded_context``, so around
``configure_model``, ``Trainer.init_module()`` and ``fabric.init_module()``), every ``nn.Parameter`` a module
registers becomes a :class:`~lightning_zero._stage3.lazy.LazyTensor`: it records what the user's code does to it,
during construction and after it until the module is set up (Hugging Face's ``post_init``, ``from_pretrained``'s
loads, ``model.apply(init_fn)``, ``torch.nn.init.*``, ``load_state_dict``, ``copy_``), and holds no memory of its
own: a parameter born from ``torch.empty`` (every ``torch.nn`` layer's) is recorded as such, and what writes it whole
lets go of what came before. Buffers are created as usual and keep their values.

At set-up (:meth:`MetaInit.plan`, before ``fully_shard``), each lazy parameter is replaced by a meta parameter;
after sharding, :func:`materialize` gives every shard its values one parameter at a time: rank 0 replays the
parameter's record (see :mod:`~lightning_zero._stage3.lazy`) and broadcasts it, and every rank keeps its rows, so a
rank holds at most its shards plus one whole parameter (plus the source tensors a user copied in). The values are
the ones eager construction gives on rank 0, bit for bit, as under DDP, which starts every rank from rank 0's.

Parameters the user created on the meta device themselves (``torch.device("meta")``, as ``FSDPStrategy`` users do)
stay meta as eager construction leaves them; those whose module defines ``reset_parameters()`` get its values then,
replayed on that module's temporary full tensors, from rank 0's generator state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zero._stage3.lazy import SCRATCH, Arena, Empty, LazyTensor, Source
from lightning_zero._stage3.seam import my_rows
from lightning_zero._transport.mesh import DataParallelMesh

aten = torch.ops.aten
_EMPTY_FACTORIES = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}


def can_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


class _FreshStorages(TorchDispatchMode):
    """Whether a tensor is the output of the last operation, and that operation was ``torch.empty``: a parameter
    registered on it (``nn.Parameter(torch.empty(...))``, every ``torch.nn`` layer's idiom) holds nothing worth
    keeping. Any operation in between (a write, a read, a view) makes it count as values."""

    def __init__(self) -> None:
        super().__init__()
        self._last: weakref.ref[torch.UntypedStorage] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        fresh = func in _EMPTY_FACTORIES and type(out) is torch.Tensor and not out.is_meta
        self._last = weakref.ref(out.untyped_storage()) if fresh else None
        return out

    def holds(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        last = self._last() if self._last is not None else None
        whole = tensor.storage_offset() == 0 and tensor.is_contiguous() and tensor.nbytes == storage.nbytes()
        return last is not None and last._cdata == storage._cdata and whole


class MetaInit:
    """Re-entrant context in which registered parameters become lazy (see the module's docs)."""

    def __init__(self) -> None:
        self._depth = 0
        self._original = nn.Module.register_parameter
        self._fresh: _FreshStorages | None = None
        # id(eager param) -> (weak ref to it, its lazy replacement): one eager parameter registered twice stays one
        self._replaced: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}
        self._creators: dict[int, tuple[nn.Parameter, nn.Module]] = {}  # id(user's meta param) -> (it, its creator)

    @contextmanager
    def __call__(self) -> Generator[None, None, None]:
        if self._depth == 0:
            self._original = nn.Module.register_parameter

            def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
                self._register(module, name, param)

            nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
            self._fresh = _FreshStorages()
            self._fresh.__enter__()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                assert self._fresh is not None
                self._fresh.__exit__(None, None, None)
                self._fresh = None
                nn.Module.register_parameter = self._original  # type: ignore[method-assign]
                self._replaced.clear()

    def _register(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or type(param) is not nn.Parameter:  # nothing, a lazy one already, or a subclass
            self._original(module, name, param)
            return
        if param.is_meta:  # the user's own meta parameter: left as eager construction leaves it
            self._creators.setdefault(id(param), (param, module))
            self._original(module, name, param)
            return
        known = self._replaced.get(id(param))
        if known is not None and known[0]() is param:
            lazy = known[1]
        else:
            assert self._fresh is not None
            with torch.no_grad():
                birth = Empty() if self._fresh.holds(param) else Source(param.detach())
                lazy = nn.Parameter(LazyTensor.born(param, birth), requires_grad=param.requires_grad)
            for attribute, value in vars(param).items():  # marks libraries set (Hugging Face's `_is_hf_initialized`)
                setattr(lazy, attribute, value)
            self._replaced[id(param)] = (weakref.ref(param), lazy)
        self._original(module, name, lazy)

    def plan(self, root: nn.Module) -> Plan:
        """What gives ``root``'s parameters their values after sharding. Call it before ``fully_shard``: it replaces
        each lazy parameter by a meta parameter of its layout (one for each, so ties stay ties), and lazy buffers by
        their values."""
        plan = Plan()
        metas: dict[int, nn.Parameter] = {}
        for module in root.modules():
            for name, param in module._parameters.items():
                if isinstance(param, LazyTensor):
                    if id(param) not in metas:
                        meta = torch.empty_strided(param.size(), param.stride(), dtype=param.dtype, device="meta")
                        metas[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
                        plan.lazy[id(metas[id(param)])] = param
                    module._parameters[name] = metas[id(param)]
            for name, buffer in module._buffers.items():
                if isinstance(buffer, LazyTensor):
                    module._buffers[name] = buffer.real_view().clone()
        parameters = {id(lazy._record) for lazy in plan.lazy.values()}
        for module in root.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, LazyTensor):
                    setattr(module, name, _attribute_values(module, name, value, parameters))
        # nothing gave these values (Lightning's `empty_init=True` skips `torch.nn.init`): garbage under eager
        # construction, so their module's `reset_parameters()` is as right and friendlier, as `FSDPStrategy` does
        unset = {pid for pid, lazy in plan.lazy.items() if not lazy._record.initialised}
        plan.resets = self._resets(root, exclude=set(plan.lazy) - unset, optional=unset)
        return plan

    def _resets(self, root: nn.Module, exclude: set[int], optional: set[int]) -> list[Reset]:
        """The ``reset_parameters()`` calls that give the meta parameters not in ``exclude`` their values, in order;
        those in ``optional`` may have no module to reset them (they keep what memory held)."""
        holders: dict[int, list[nn.Module]] = {}
        for module in root.modules():
            for param in module._parameters.values():
                if param is not None and param.is_meta and id(param) not in exclude:
                    holders.setdefault(id(param), []).append(module)
        owner: dict[int, nn.Module] = {}
        for pid, modules in holders.items():
            creator = self._creators.get(pid, (None, None))[1]
            resettable = [m for m in modules if can_reset(m)]
            if creator in modules and can_reset(creator):
                owner[pid] = creator
            elif resettable:
                owner[pid] = resettable[0]  # its creator left the model (replaced, say): the first holder that can
        orphans = [n for n, p in root.named_parameters(remove_duplicate=False) if p.is_meta and id(p) in holders]
        orphans = [n for n in orphans if id(root.get_parameter(n)) not in owner.keys() | optional]
        if orphans:
            raise ValueError(
                f"Parameters {orphans} are on the meta device, held only by modules without `reset_parameters()`, so"
                " nothing can give them values. HINT: create them without `device='meta'` (inside `configure_model`"
                " every parameter is built without memory anyway), or define `reset_parameters()` on their module."
            )
        resets = []
        for module in root.modules():
            names = [n for n, p in module._parameters.items() if p is not None]
            metas = [n for n in names if id(module._parameters[n]) in holders]
            if metas and can_reset(module):
                owned = [n for n in metas if owner.get(id(module._parameters[n])) is module]
                resets.append(Reset(module, names, owned))
        self._creators.clear()
        return resets


def _attribute_values(module: nn.Module, name: str, value: LazyTensor, parameters: set[int]) -> torch.Tensor:
    """A plain attribute computed from parameters while building gets its values; a view of a parameter (its record
    in ``parameters``) cannot follow it into its shards."""
    if id(value._record) in parameters:
        raise RuntimeError(
            f"`{type(module).__name__}.{name}` is a view of a parameter, kept as a plain attribute; stage 3 replaces"
            " parameters by their shards, which such a view cannot follow. HINT: compute it from the parameter in"
            " `forward`, or register it as a parameter or buffer of its own."
        )
    return value.real_view().clone()


@dataclass
class Reset:
    """One module's ``reset_parameters()`` call, for the user's own meta parameters."""

    module: nn.Module
    names: list[str]  # the module's own parameters, all of which the call gets as temporary full tensors
    owned: list[str]  # those whose values it provides (a tied parameter is provided by one module only)


@dataclass
class Plan:
    """What gives a module's meta parameters their values after sharding."""

    lazy: dict[int, LazyTensor] = field(default_factory=dict)  # id(meta param before sharding) -> its record
    resets: list[Reset] = field(default_factory=list)

    def by_name(self, root: nn.Module) -> list[tuple[str, LazyTensor]]:
        """``(name, lazy tensor)`` for each lazy parameter of ``root``, before sharding (one name per tie)."""
        return [(n, self.lazy[id(p)]) for n, p in root.named_parameters() if id(p) in self.lazy]


def materialize(
    root: nn.Module,
    plan: Plan,
    names: list[tuple[str, LazyTensor]],
    device: torch.device,
    mesh: DataParallelMesh,
    shards_on_host: bool = False,
    filled: Callable[[str], None] | None = None,
) -> None:
    """Give every meta parameter of the sharded ``root`` storage on ``device`` and its values (see module docs);
    ``names``: :meth:`Plan.by_name` before sharding. With ``shards_on_host`` (offload), the shards then move to host
    memory, where ``fully_shard`` expects them. ``filled`` is told the name of each parameter as it gets its values
    from its record (its storage stays the parameter's, wherever ``filled`` moves it)."""
    if not names and not plan.resets:
        return
    with torch.no_grad():
        if any(p.is_meta for p in root.parameters()):  # `fully_shard`'s shards have no storage yet
            kept = [(p, _local(p).clone()) for p in root.parameters() if not p.is_meta]
            buffers = [
                (m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta
            ]
            root.to_empty(device=device)  # also empties what was real: restored right below
            for param, values in kept:
                _local(param).copy_(values)
            for module, name, buffer in buffers:
                module._buffers[name] = buffer
        SCRATCH.release()  # what recorded random operations ran on: they are recorded
        source, arena = dist.get_global_rank(mesh.world, 0), Arena()
        for name, lazy in names:
            if lazy._record.initialised:  # never written: garbage under eager too, and the shard's is as good
                _fill(root.get_parameter(name), lazy, device, mesh, source, arena)
                if filled is not None:
                    filled(name)
        arena.release()
        if plan.resets:  # from rank 0's generator, which set-up leaves as it found it, as eager construction does
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                _share_rank0_generator(device, mesh.world)
                for reset in plan.resets:
                    _replay(reset, device, mesh.shard_group)
        if shards_on_host and device.type != "cpu":
            root._apply(lambda t: t.cpu() if isinstance(t, DTensor) else t)


def _fill(
    param: torch.Tensor, lazy: LazyTensor, device: torch.device, mesh: DataParallelMesh, source: int, arena: Arena
) -> None:
    """Rank 0 replays the parameter's record and broadcasts it whole; each rank keeps its rows."""
    if dist.get_rank() == source:
        full = lazy.real_view(arena).to(device).contiguous()
    else:
        full = arena.take(lazy.shape, None, lazy.dtype, device)
    with torch.profiler.record_function("lightning_zero::broadcast_initial_values"):
        dist.broadcast(full, src=source, group=mesh.world)
    local = _local(param)
    local.copy_(_my_rows(full, local, mesh.shard_group) if isinstance(param, DTensor) else full)


def _replay(reset: Reset, device: torch.device, group: ProcessGroup) -> None:
    module = reset.module
    live = {n: module._parameters[n] for n in reset.names}
    full = {
        n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for n, p in live.items()
        if p is not None
    }
    module._parameters.update(full)
    try:
        module.reset_parameters()  # type: ignore[operator]
    finally:
        module._parameters.update(live)
    for name in reset.owned:
        param = live[name]
        assert param is not None
        local = _local(param)
        local.copy_(_my_rows(full[name], local, group) if isinstance(param, DTensor) else full[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _my_rows(full: torch.Tensor, local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's rows of ``full`` under ``Shard(0)``, as ``fully_shard`` splits (the seam's contract item)."""
    mine = my_rows(full, group.rank(), group.size())
    if mine.shape != local.shape:
        raise RuntimeError(f"A shard of shape {tuple(local.shape)} is not this rank's rows of {tuple(full.shape)}.")
    return mine


def _share_rank0_generator(device: torch.device, group: ProcessGroup) -> None:
    """Set every rank's random generator (CPU, and the device's) to rank 0's state."""
    states = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]
    with torch.profiler.record_function("lightning_zero::broadcast_generator_state"):
        dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)
