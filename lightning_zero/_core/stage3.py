"""Stage 3 on the package's engine (:mod:`lightning_zero._stage3.engine`): the module holds this rank's rows of each
parameter, each unit is gathered around its forward and its backward, gradients are reduce-scattered a unit at a
time, and the optimizers step on the shards, wrapped as in stages 1 and 2."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero._checkpoint.live import OptimizerEntries
from lightning_zero._core.mode import LifeCycle, sync_from_rank_zero
from lightning_zero._core.optimizers import as_set_up
from lightning_zero._core.parameters import ParametersMode
from lightning_zero._engine.engine import EnginePrecision
from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.optimizer import ZeroOptimizer, check_built_on
from lightning_zero._engine.reducers import GradHome, ReduceMode
from lightning_zero._stage3.engine import Stage3Engine
from lightning_zero._stage3.meta_init import materialize
from lightning_zero._stage3.step import rows_of_whole_tensors, run_as_root_forward
from lightning_zero._wrap import choose_units
from lightning_zero.memory import BufferHolder

# Each LightningModule's engine, which refers to the module only through its hooks, so that a later run of the same
# module (``validate`` after ``fit``) finds its shards where they are.
_BY_MODULE: weakref.WeakKeyDictionary[nn.Module, Stage3Engine] = weakref.WeakKeyDictionary()


class Stage3Mode(ParametersMode):
    """Stage 3 with everything on the device: the package's engine gathers the units."""

    keeps_sync_batchnorm = True
    replaces_grad_scaler = True  # fp16 gradients end up in shards, as in stages 1 and 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: Stage3Engine | None = None  # from the first ``setup_module`` on
        self._scaler: LossScaler | None = None

    def _place(self, module: nn.Module) -> None:
        """Shard the module into its units, then give parameters built without memory their values, shard by shard.
        A module sharded before (a later ``fit``, ``validate``, ...) stays as it is."""
        existing = _BY_MODULE.get(module)
        if existing is not None:
            self.engine = existing
            existing.at_rest()
            return
        self._remember_names(module)
        plan = self.meta_init.plan(module)
        lazy = plan.by_name(module)
        meta = {name for name, p in module.named_parameters() if p.is_meta}
        module._apply(lambda t: t if t.is_meta else t.to(self.device))
        mesh = self._mesh()
        sync_from_rank_zero(module, mesh.world, skip=meta)  # meta ones are drawn from rank 0's generator
        # decided on the module as built (the shards of 16-bit parameters are then the fp32 masters)
        precision = EnginePrecision.of(self.config, module, replaces_grad_scaler=False)
        units = choose_units(module, self.config.auto_wrap_policy)
        keep = self.config.keep_for_backward_bytes
        wire, secondary = self._zero_plus_plus(mesh)
        self.engine = Stage3Engine(module, units, mesh, self.device, precision, keep, wire, secondary)
        for owner in module.modules():
            if any(isinstance(p, DTensor) for p in owner._parameters.values()):
                owner.register_load_state_dict_pre_hook(self._whole_tensors_as_rows)
        materialize(module, plan, lazy, self.device, mesh)
        _BY_MODULE[module] = self.engine

    def _whole_tensors_as_rows(self, owner: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """Loading a full state dict: the module at rest first (the root stays gathered after an evaluation), then
        whole tensors become this rank's rows."""
        self.at_rest()
        rows_of_whole_tensors(owner, state_dict, prefix)

    def _wrap_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], grad_scaler_taken: bool
    ) -> list[Optimizer]:
        """The optimizers step on the shards (built on them after sharding, or moved to them here), wrapped as in
        stages 1 and 2: the reduced gradients are the shards', and fp32 masters need no copy back (the shards are
        the masters, cast as each unit is gathered)."""
        engine = self._placed()
        for optimizer in optimizers:
            self._adopt_shards(module, optimizer)
        if self.state is not LifeCycle.TRAINING:  # the first optimizers of this `fit`
            precision = engine.precision
            self._scaler = LossScaler(engine.group) if precision.loss_scaling or grad_scaler_taken else None
            engine.reduce_gradients(precision.reduce_dtype, self._scaler, self.config.bucket_bytes)
        shards = engine.by_param()
        wrapped: list[Optimizer] = []
        for optimizer in optimizers:
            check_built_on(optimizer, shards)
            kernels = self.placement.shard_kernels
            wrapped.append(ZeroOptimizer(optimizer, shards, GradHome.SHARD, None, self._scaler, choose_kernels=kernels))
        return wrapped

    def _placed(self) -> Stage3Engine:
        assert self.engine is not None, f"the module is not set up yet ({self.state})"
        return self.engine

    @property
    def loss_scaler(self) -> LossScaler | None:
        return self._scaler

    @property
    def buffers(self) -> BufferHolder | None:
        return self.engine

    @property
    def _sync_group(self) -> ProcessGroup | None:
        return None if self.state is LifeCycle.NEW else self._placed().mesh.world

    @property
    def _gradient_sync(self) -> bool:
        reducer = None if self.engine is None else self.engine.reducer
        return reducer is None or reducer.mode is ReduceMode.SYNC

    def run_step(self, plain: Callable[[], Any], as_forward: Callable[[], Any]) -> Any:
        """Every step runs as the root unit's forward, so that the root stays gathered through it."""
        return run_as_root_forward(as_forward)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Each backward still reduces into the gradient shards (as stage 2), so whole gradients never accumulate;
        the next step then does not broadcast buffers, DDP's rule."""
        reducer = None if self.engine is None else self.engine.reducer
        if reducer is None or self.state is not LifeCycle.TRAINING:
            yield
            return
        previous, reducer.mode = reducer.mode, ReduceMode.LOCAL
        try:
            yield
        finally:
            reducer.mode = previous

    def optimizer_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        """The step; the units gather the shards' new values when they next run."""
        result = super().optimizer_step(optimizer, step)
        self._placed().after_step()
        return result

    def at_rest(self) -> None:
        if self.engine is not None:
            self.engine.at_rest()

    def optimizer_entries(self, optimizer: Optimizer) -> OptimizerEntries:
        """A sharded optimizer's state is laid out like the shards it updates."""
        optimizer = as_set_up(optimizer)
        if isinstance(optimizer, ZeroOptimizer):
            return OptimizerEntries(optimizer, optimizer.updated_tensors(), self.placement.state_like)
        return super().optimizer_entries(optimizer)

    def settle_after_failure(self) -> None:
        if self.engine is not None:
            self.engine.settle()
