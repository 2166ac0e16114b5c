"""Stage 3 for models too large for one rank: parameters born on the meta device, materialised shard by shard.

Under :class:`MetaInit` (the strategy enters it in ``tensor_init_context`` and ``model_sharded_context``, so around
``configure_model`` and ``Trainer.init_module()``), a parameter registered by a module that can initialise itself
again, one that defines ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ...), is replaced
by a meta tensor of its shape: no memory, no initialisation work. Everything else is created as usual and keeps the
values its constructor gave it: buffers (masks, tables, BatchNorm statistics, metric states) and the parameters of
modules without ``reset_parameters()`` (a bare ``nn.Parameter(torch.randn(...))`` on a custom module), which should
therefore be small.

After ``fully_shard`` (the shards of such parameters are meta DTensors then), :func:`materialize` allocates every
shard on the device and replays, in module registration order, each ``reset_parameters()`` that had meta parameters,
on temporary full tensors of that one module, keeping this rank's rows. A rank so holds at most its shards plus one
module's full parameters. As construction order is registration order, the replay draws from the random generator in
the order eager construction would have, from rank 0's generator state shared with every rank: the weights are the
ones eager construction under the same seed gives, on any number of ranks. A tied parameter takes the values of the
module that created it, as in eager construction, where the tie replaces the other module's own parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_zero._engine.layout import ShardSpec
from lightning_zero._transport.mesh import DataParallelMesh


def can_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


class MetaInit:
    """Re-entrant context in which parameters of resettable modules are created on the meta device.

    It remembers which module created each meta parameter, for :meth:`plan`.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._original = nn.Module.register_parameter
        self._creators: dict[int, tuple[nn.Parameter, nn.Module]] = {}  # id(meta param) -> (it, its creator)
        # id(eager param) -> (weak ref to it, its meta replacement): one eager parameter registered twice stays one
        self._replaced: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}

    @contextmanager
    def __call__(self) -> Generator[None, None, None]:
        if self._depth == 0:
            self._original = nn.Module.register_parameter

            def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
                self._register(module, name, param)

            nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                nn.Module.register_parameter = self._original  # type: ignore[method-assign]
                self._replaced.clear()

    def _register(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        self._original(module, name, param)
        if param is None or type(param) is not nn.Parameter or param.is_meta or not can_reset(module):
            return
        known = self._replaced.get(id(param))
        if known is not None and known[0]() is param:
            meta = known[1]
        else:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            self._replaced[id(param)] = (weakref.ref(param), meta)
            self._creators[id(meta)] = (meta, module)
        module._parameters[name] = meta

    def plan(self, root: nn.Module) -> list[Reset]:
        """The ``reset_parameters()`` calls that will give ``root``'s meta parameters their values, in order.

        Call it before ``fully_shard`` (which replaces the parameters): it reads which module owns which parameter.
        """
        holders: dict[int, list[nn.Module]] = {}
        for module in root.modules():
            for param in module._parameters.values():
                if param is not None and param.is_meta:
                    holders.setdefault(id(param), []).append(module)
        owner: dict[int, nn.Module] = {}
        for pid, modules in holders.items():
            creator = self._creators.get(pid, (None, None))[1]
            resettable = [m for m in modules if can_reset(m)]
            if creator in modules and can_reset(creator):
                owner[pid] = creator
            elif resettable:
                owner[pid] = resettable[0]  # its creator left the model (replaced, say): the first holder that can
        orphans = [n for n, p in root.named_parameters(remove_duplicate=False) if p.is_meta and id(p) not in owner]
        if orphans:
            raise ValueError(
                f"Parameters {orphans} are on the meta device, held only by modules without `reset_parameters()`, so"
                " nothing can give them values. HINT: define `reset_parameters()` on their module, or create them"
                " outside `configure_model` / `Trainer.init_module()`."
            )
        resets = []
        for module in root.modules():
            names = [n for n, p in module._parameters.items() if p is not None]
            metas = [n for n in names if module._parameters[n].is_meta]  # type: ignore[union-attr]
            if metas and can_reset(module):
                owned = [n for n in metas if owner.get(id(module._parameters[n])) is module]
                resets.append(Reset(module, names, owned))
        self._creators.clear()
        return resets


@dataclass
class Reset:
    """One module's ``reset_parameters()`` call in the replay."""

    module: nn.Module
    names: list[str]  # the module's own parameters, all of which the call gets as temporary full tensors
    owned: list[str]  # those whose values it provides (a tied parameter is provided by one module only)


def materialize(
    root: nn.Module, resets: list[Reset], device: torch.device, mesh: DataParallelMesh, shards_on_host: bool = False
) -> None:
    """Give every meta parameter of the sharded ``root`` storage on ``device`` and its values (see module docs);
    with ``shards_on_host`` (offload), the shards then move to host memory, where ``fully_shard`` expects them."""
    if not any(p.is_meta for p in root.parameters()):
        return
    with torch.no_grad():
        kept = [(p, _local(p).clone()) for p in root.parameters() if not p.is_meta]
        buffers = [(m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]
        root.to_empty(device=device)  # also empties what was real: restored right below
        for param, values in kept:
            _local(param).copy_(values)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer
        _share_rank0_generator(device, mesh.world)
        for reset in resets:
            _replay(reset, device, mesh.shard_group)
        if shards_on_host:
            root._apply(lambda t: t.cpu() if isinstance(t, DTensor) else t)


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
    """This rank's rows of ``full`` under ``Shard(0)``, as ``fully_shard`` splits (see :class:`ShardSpec`)."""
    mine = ShardSpec(full.shape, group.size()).take(full, group.rank())
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
