"""Stage 3: the LightningModule sharded by torch's ``fully_shard`` (FSDP2), and what Lightning needs around it.

``fully_shard`` is applied to every unit the wrap policy chose (deepest first) and then to the LightningModule, the
root unit, on a 1-D mesh over all ranks. It replaces each parameter by a ``Shard(0)`` DTensor of this rank's rows,
which is what ``configure_optimizers`` sees and the optimizer updates; it all-gathers a unit's parameters around the
unit's forward and backward and reduce-scatters (averaging) its gradients into the shards' ``.grad``. On gloo those
two collectives are this package's (:mod:`lightning_zero._stage3.collectives`): shared memory between the ranks of one
host, point-to-point exchanges otherwise.

Two kinds of parameters live outside that scheme:

- **replicated** parameters: 0-dim ones, which ``fully_shard`` cannot split. Every rank keeps all of each, like DDP:
  rank 0's value at setup, gradients averaged after each synchronised backward
  (:meth:`ShardedModule.reduce_replicated_grads`), the same update everywhere.
- parameters read in ``training_step`` outside ``forward`` (a penalty on a weight, a tied head used by hand): each
  step runs as the root's forward (see :meth:`ShardedModule.step`), so every parameter of the root unit is gathered,
  a plain tensor, for the whole step, forward or not. A parameter of a smaller unit is gathered only inside that
  unit's forward and backward; read elsewhere it is this rank's shard, a DTensor, and the step fails with an error
  that says so (a loss computed from a shard is refused before backward: its gradient would be wrong or fail).
  Keeping such a module in the root unit (the default policy only picks repeated container entries) fixes it.

Every rank must gather the same units in the same order. Where the units' collectives go through shared memory, each
is labelled with its unit and ranks that diverge (a ``generate()`` that stops earlier on one rank, a branch taken by one
rank) fail at once on every rank, and every rank meets the others at the end of each forward of the whole module (a
Trainer step's forward), so that a rank that finished early cannot go on to other collectives and leave its peers
waiting in a gather (:mod:`lightning_zero._transport.labels`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_zero._config import ZeroConfig
from lightning_zero._engine.layout import ShardSpec
from lightning_zero._grouping import group_by
from lightning_zero._offload.placement import Placement
from lightning_zero._stage3 import collectives as unit_collectives
from lightning_zero._stage3.seam import (
    Around,
    around_own_collectives,
    check_contract,
    forget_own_collectives,
    has_run_forward,
    own_collective_arounds,
    reset_after_failure,
    secondary_groups,
)
from lightning_zero._stage3.step import rows_of_whole_tensors, run_as_root_forward
from lightning_zero._transport import activity, labels
from lightning_zero._transport import collectives as comm
from lightning_zero._transport.mesh import DataParallelMesh, Split
from lightning_zero._transport.quantized import EXACT, Wire


@contextmanager
def _resharding_after_forward(
    mesh: DataParallelMesh, secondary: Split | None
) -> Generator[dict[str, Any], None, None]:
    """The arguments of ``fully_shard`` for each unit: none (reshard to the shard group), or the secondary parts'."""
    if secondary is None:
        yield {}
        return
    parts, size = secondary.across.size(), secondary.inner.size()
    ranks = dist.get_process_group_ranks(mesh.shard_group)
    grid = [ranks[part * size : (part + 1) * size] for part in range(parts)]
    with secondary_groups(secondary.inner, secondary.across, grid, mesh.shard.device_type) as part_size:
        yield {"reshard_after_forward": part_size}


# Each sharded LightningModule's ShardedModule, which refers to the module only weakly, so that the entry (and all it
# holds: shards, hooks) goes when the user drops the module.
_BY_MODULE: weakref.WeakKeyDictionary[nn.Module, ShardedModule] = weakref.WeakKeyDictionary()


class ShardedModule:
    """A module under ``fully_shard``, with its replicated parameters and its gradient-sync switch."""

    def __init__(
        self,
        module: nn.Module,
        mesh: DataParallelMesh,
        units: list[nn.Module],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy | None = None,
        placement: Placement | None = None,
        wire: Wire = EXACT,
        secondary: Split | None = None,
    ) -> None:
        """``wire``: what crosses between hosts quantized; ``secondary``: the shard group's parts (and their
        counterparts) each unit stays sharded within between its forward and its backward (ZeRO++'s secondary
        partition)."""
        self._module = weakref.ref(module)
        offload_policy = placement.fsdp_offload_policy(device) if placement is not None else None
        self.shards_on_host = offload_policy is not None  # the placement's: shards, gradients, optimizer state
        self.group: ProcessGroup = mesh.world  # every data-parallel rank: replicated gradients average over them
        self.replicated = [p for p in module.parameters() if p.dim() == 0]
        policies = {
            "ignored_params": set(self.replicated),
            "mp_policy": mp_policy or MixedPrecisionPolicy(),
            "offload_policy": offload_policy or OffloadPolicy(),  # a CPUOffloadPolicy keeps the shards on the host
        }
        param_dtype = mp_policy.param_dtype if mp_policy is not None else None
        sizes = [
            gathered_bytes(params, mesh.shard.size(), param_dtype)
            for params in _unit_parameters([*units, module], set(self.replicated))
        ]
        # The ring rotates the units; the root is gathered once a step and stays gathered through it, so a root
        # larger than every unit (embeddings, a head) goes through the channel's slots rather than triple the ring.
        largest = max(sizes[:-1] or sizes)
        with _resharding_after_forward(mesh, secondary) as after_forward:
            for unit in units:  # deepest first
                fully_shard(unit, mesh=mesh.shard, **after_forward, **policies)
        fully_shard(module, mesh=mesh.shard, **policies)
        check_contract([*units, module])  # now, not at the first step: a torch whose internals differ says so here
        self._channel = unit_collectives.install([*units, module], mesh.shard_group, largest, mesh.replicate, wire)
        self._forwards = 0  # forwards of the whole module under way: a step's forward may call `self(...)` inside
        # between runs: each unit's arounds of `fully_shard`'s own collectives, taken out of torch (see `suspend`),
        # by the unit's path: this object must not hold the module it belongs to
        self._suspended: dict[str, tuple[Around, Around]] = {}
        for param in self.replicated:  # `fully_shard` leaves ignored parameters where they are
            param.data = param.data.to(device)
        self.gradient_sync = True  # False during the micro-batches of an accumulation window but the last
        # What the optimizer holds: the parameters registered while every unit is sharded, i.e. now.
        # (owning module's parameter dict, name, shard): the dicts, not the modules, so nothing here holds the module
        self._shards = [
            (m._parameters, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None
        ]
        module.register_forward_pre_hook(self._follow_requires_grad)
        module.register_forward_pre_hook(self._enter_forward)
        module.register_forward_hook(self._leave_forward)
        for owner in module.modules():
            if any(isinstance(p, DTensor) for p in owner._parameters.values()):
                owner.register_load_state_dict_pre_hook(self._shard_full_tensors)
        _BY_MODULE[module] = self

    @property
    def module(self) -> nn.Module:
        module = self._module()
        assert module is not None, "the sharded module was garbage-collected"
        return module

    @staticmethod
    def of(module: nn.Module) -> ShardedModule | None:
        """The object that sharded ``module``, if one did."""
        return _BY_MODULE.get(module)

    def run_as_forward(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward``: a LightningModule hook (``training_step``, ...) called as the root's forward through
        Lightning's forward redirection, so that the root unit is gathered for the whole step, whatever the step
        calls, and the root's hooks run even when the step never calls ``self(...)``."""
        return run_as_root_forward(forward)

    def _follow_requires_grad(self, *_: Any) -> None:
        """The root unit stays gathered through a step, so its gathered parameters miss a ``requires_grad`` change
        made on the shards meanwhile (``toggle_optimizer`` in manual optimization); copy it over."""
        for parameters, name, sharded in self._shards:
            current = parameters[name]
            if current is not sharded and current is not None and current.requires_grad != sharded.requires_grad:
                current.requires_grad_(sharded.requires_grad)

    def _enter_forward(self, *_: Any) -> None:
        self._forwards += 1

    def _leave_forward(self, *_: Any) -> None:
        """At the end of the outermost forward of the whole module, every rank meets the others (see the module)."""
        self._forwards -= 1
        if self._forwards == 0:
            activity.entered(labels.END_OF_FORWARD)
            if self._channel is not None:
                self._channel.meet(labels.END_OF_FORWARD)

    @contextmanager
    def gradient_sync_disabled(self) -> Generator[None, None, None]:
        """Micro-batches before the last of an accumulation window: ``fully_shard``'s no-sync (each unit keeps its
        full gradient until the synchronised backward), and no averaging of the replicated gradients."""
        assert isinstance(self.module, FSDPModule)
        self.module.set_requires_gradient_sync(False)
        self.gradient_sync = False
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            self.gradient_sync = True

    def reduce_replicated_grads(self) -> None:
        """Average the replicated parameters' gradients over ranks, DDP's way: a rank without one counts as zero, and
        a parameter that no rank produced a gradient for keeps ``grad is None``."""
        params = [p for p in self.replicated if p.requires_grad]
        by_dtype = group_by(params, lambda p: (p.dtype, p.device))
        with torch.no_grad():
            for (dtype, device), same in by_dtype.items():
                flat = torch.zeros(2 * len(same), dtype=dtype, device=device)  # gradients, then presence flags
                for i, param in enumerate(same):
                    if param.grad is not None:
                        flat[i] = param.grad
                        flat[len(same) + i] = 1
                comm.all_reduce_sum(flat, self.group).wait()
                flat[: len(same)] /= self.group.size()
                # every one present here: no read (it would wait for the device); else one read of all the flags
                here = [param.grad is not None for param in same]
                present = here if all(here) else [flag > 0 for flag in flat[len(same) :].tolist()]
                for i, param in enumerate(same):
                    if present[i]:
                        param.grad = flat[i].clone()

    def suspend(self) -> None:
        """At a run's teardown: take out of torch what this module put there for the whole process (the arounds of
        ``fully_shard``'s own collectives, where it keeps them), so that other ``fully_shard`` modules of the process
        run as in a fresh one. :meth:`resume` puts them back."""
        for path, unit in self._units().items():
            arounds = own_collective_arounds(unit)
            if arounds is not None:
                self._suspended[path] = arounds
                forget_own_collectives(unit)

    def resume(self) -> None:
        """Before the module runs again (a later ``fit``, ``validate``, ...): what :meth:`suspend` took out."""
        units = self._units()
        for path, (gather, reduce) in self._suspended.items():
            around_own_collectives(units[path], gather, reduce)
        self._suspended.clear()

    def _units(self) -> dict[str, FSDPModule]:
        """Each unit by its path in the module (the root's is ``""``)."""
        return {path: unit for path, unit in self.module.named_modules() if isinstance(unit, FSDPModule)}

    def reshard(self) -> None:
        """Free the root unit's gathered parameters (after an evaluation loop: it stays gathered after forward)."""
        assert isinstance(self.module, FSDPModule)
        self.module.reshard()

    def settle(self) -> None:
        """After an exception aborted a step: drop the step's unfinished gathers and gradient reductions and reshard
        every unit, the root included (it stays gathered through a step), so that the module is at rest again and can
        be moved, saved or trained. The aborted step's gradients are lost."""
        self._forwards = 0  # the aborted forward never left
        module = self.module
        assert isinstance(module, FSDPModule)
        if not has_run_forward(module):  # nothing gathered yet, and no per-step state to reset
            return
        reset_after_failure(module)

    def _shard_full_tensors(self, owner: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """Before ``load_state_dict`` copies into ``owner``'s parameters: the root unit may still be gathered after an
        evaluation's forward, so it is resharded first, then whole tensors become this rank's rows."""
        self.reshard()
        rows_of_whole_tensors(owner, state_dict, prefix)


def precision_policy(config: ZeroConfig, module: nn.Module) -> MixedPrecisionPolicy | None:
    """ZeRO mixed precision in stage 3: the sharded parameters (the optimizer's masters) are fp32 (see
    :func:`masters_in_fp32`) while ``fully_shard`` gathers them in the module's 16-bit dtype and reduces gradients in
    that dtype (or ``reduce_dtype``)."""
    reduce_dtype = config.reduce_dtype
    if not config.master_weights:
        return None if reduce_dtype is None else MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if dtypes != {torch.bfloat16}:
        raise ValueError(
            f"`master_weights=True` in stage 3 keeps fp32 shards of a bf16 module; the module's parameters are"
            f" {sorted(map(str, dtypes))}. HINT: pass `Trainer(precision='bf16-true')`; fp16 master weights with"
            " loss scaling run in stages 1 and 2."
        )
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype or torch.bfloat16)


def masters_in_fp32(module: nn.Module) -> None:
    """Make the 16-bit parameters fp32 before ``fully_shard``: its shards are then the optimizer's fp32 masters."""
    for param in module.parameters():
        param.data = param.data.float()


def gathered_bytes(params: list[nn.Parameter], world_size: int, param_dtype: torch.dtype | None) -> int:
    """What ``fully_shard`` all-gathers for one unit: each parameter's rows padded to a multiple of the world size, in
    the dtype it is gathered in."""
    total = 0
    for param in params:
        spec = ShardSpec(param.shape, world_size)
        total += spec.padded_rows * spec.row_numel * (param_dtype or param.dtype).itemsize
    return total


def _unit_parameters(units: list[nn.Module], ignored: set[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters each unit manages, in ``fully_shard``'s order (deepest first, the root last): those of its
    subtree that no earlier unit took."""
    taken = set(ignored)
    managed = []
    for unit in units:
        own = [p for p in unit.parameters() if p not in taken]
        taken.update(own)
        managed.append(own)
    return managed
