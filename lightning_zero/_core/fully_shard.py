"""Stage 3: ``fully_shard`` shards the parameters too; each unit is gathered only around its forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_zero._core.mode import LifeCycle, sync_from_rank_zero
from lightning_zero._core.parameters import ParametersMode
from lightning_zero._stage3.meta_init import materialize
from lightning_zero._stage3.sharded_module import ShardedModule, masters_in_fp32, precision_policy
from lightning_zero._warning_filter import RunFilter
from lightning_zero._wrap import choose_units

_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class FullyShardMode(ParametersMode):
    """The module's units and the module itself (the root unit) under ``fully_shard``; the optimizers step on the
    DTensor shards it leaves in the module, on the host when offloaded."""

    keeps_sync_batchnorm = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharded: ShardedModule | None = None  # from the first ``setup_module`` on (any state but ``NEW``)
        self._quiet = RunFilter(_VIEW_WARNING, UserWarning)

    def _place(self, module: nn.Module) -> None:
        """Apply ``fully_shard`` to the units and the module, then give parameters built without memory their values,
        shard by shard. A module sharded before (a later ``fit``, ``validate``, ...) stays as it is."""
        if dist.get_rank() != 0:  # torch warns of a unit returning a view on every rank; once, on rank 0, says it
            self._quiet.add()
        existing = ShardedModule.of(module)
        if existing is not None:
            self.sharded = existing
            existing.resume()
            existing.reshard()
            return
        self._remember_names(module)
        plan = self.meta_init.plan(module)
        lazy = plan.by_name(module)
        meta = {name for name, p in module.named_parameters() if p.is_meta}
        # Everything real goes to the device first, as under DDP: `fully_shard` moves only parameters and buffers,
        # not other module state (torchmetrics' metric states), and then offloads the shards itself.
        module._apply(lambda t: t if t.is_meta else t.to(self.device))
        mesh = self._mesh()
        sync_from_rank_zero(module, mesh.world, skip=meta)  # meta ones are drawn from rank 0's generator
        units = choose_units(module, self.config.auto_wrap_policy)
        precision = precision_policy(self.config, module)
        if self.config.master_weights:  # the policy gathers them in bf16
            masters_in_fp32(module)
        wire, secondary = self._zero_plus_plus(mesh)
        self.sharded = ShardedModule(module, mesh, units, self.device, precision, self.placement, wire, secondary)
        with self.placement.materializing(module, units, self.device) as filled:
            materialize(module, plan, lazy, self.device, mesh, self.sharded.shards_on_host, filled)

    def _wrap_optimizers(self, module: nn.Module, optimizers: list[Optimizer], precision: object) -> list[Optimizer]:
        """The optimizers step on the shards as they are (built on them after sharding, or moved to them here)."""
        for optimizer in optimizers:
            self._adopt_shards(module, optimizer)
            self.placement.keep_step_kernels(optimizer)  # decided now, with the shards where they stay
        return optimizers

    def _placed(self) -> ShardedModule:
        assert self.sharded is not None, f"the module is not set up yet ({self.state})"
        return self.sharded

    @property
    def _sync_group(self) -> ProcessGroup | None:
        return None if self.state is LifeCycle.NEW else self._placed().group

    @property
    def _gradient_sync(self) -> bool:
        return self.state is LifeCycle.NEW or self._placed().gradient_sync

    def run_step(self, plain: Callable[[], Any], as_forward: Callable[[], Any]) -> Any:
        """Every step runs as the root unit's forward, so that the root stays gathered through it."""
        return self._placed().run_as_forward(as_forward)

    def no_sync(self) -> AbstractContextManager[None]:
        """``fully_shard``'s no-sync: each unit keeps its full gradient until the synchronised backward."""
        return nullcontext() if self.state is LifeCycle.NEW else self._placed().gradient_sync_disabled()

    def after_backward(self) -> None:
        if self.state is not LifeCycle.NEW and self._placed().gradient_sync:
            self._placed().reduce_replicated_grads()

    def at_rest(self) -> None:
        """Free the root unit's gathered parameters (it stays gathered after an evaluation loop's forward)."""
        if self.state is not LifeCycle.NEW:
            self._placed().reshard()

    def settle_after_failure(self) -> None:
        """A step stage 3 aborted leaves units gathered, which the front end's teardown could not move: drop the
        step's unfinished gathers and reductions and reshard every unit."""
        if self.sharded is not None:  # even if the failure came while setting up
            self.sharded.settle()

    def teardown(self) -> None:
        """What set-up put into the process for the run (arounds of torch's collectives, a warnings filter) goes;
        a later run of the same module puts it back."""
        super().teardown()
        if self.sharded is not None:
            self.sharded.suspend()

    def process_undos(self) -> list[Callable[[], None]]:
        """The c10d witness, and the filter of torch's warning about a unit returning a view."""
        return [*super().process_undos(), self._quiet.remove]
