"""Sets up stages 1 and 2 on a module and its optimizers: shards, buckets, gradient reduction, parameter gathering."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_zero._config import ZeroConfig
from lightning_zero._engine.gather import ParamGatherer
from lightning_zero._engine.layout import ShardSpec
from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.optimizer import ZeroOptimizer, check_built_on
from lightning_zero._engine.pool import BufferPool
from lightning_zero._engine.reducers import GradientReducer
from lightning_zero._engine.sharded_param import ShardedParam
from lightning_zero._offload.placement import OnDevice, Placement
from lightning_zero._transport.mesh import DataParallelMesh
from lightning_zero._transport.quantized import EXACT, Wire


@dataclass(frozen=True)
class EnginePrecision:
    """Dtypes the engine adds on top of the module's own (see ``ZeroConfig``)."""

    master_dtype: torch.dtype | None = None  # the optimizer's copy of my shard, when the module is 16-bit
    reduce_dtype: torch.dtype | None = None  # of the gradient reduction, stage 2; ``None``: the parameters' dtype
    loss_scaling: bool = False  # dynamic loss scaling, for fp16 gradients

    @classmethod
    def of(cls, config: ZeroConfig, module: nn.Module, *, replaces_grad_scaler: bool) -> EnginePrecision:
        """The dtypes the engine adds to ``module``'s. Loss scaling is the engine's wherever fp16 gradients end up in
        shards: with fp16 master-weight training, and where it ``replaces_grad_scaler``, the ``GradScaler`` of
        ``"16-mixed"`` on a GPU, which would look only at this rank's shards for overflows."""
        dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
        if config.master_weights and not dtypes & {torch.float16, torch.bfloat16}:
            raise ValueError(
                "`master_weights=True` keeps fp32 master shards of a 16-bit module, but the module's parameters are"
                f" {sorted(map(str, dtypes))}. HINT: pass `precision='bf16-true'` (or '16-true')."
            )
        fp16_master = config.master_weights and torch.float16 in dtypes
        return cls(
            master_dtype=config.master_dtype,
            reduce_dtype=config.reduce_dtype,
            loss_scaling=fp16_master or replaces_grad_scaler,
        )


def assign_buckets(params: list[ShardedParam], bucket_bytes: int) -> list[list[ShardedParam]]:
    """Split ``params`` into buckets of one dtype and device, each at most ``bucket_bytes`` unless a single
    parameter is larger. Parameters are taken in reverse registration order, roughly the order backward
    produces their gradients, so early buckets fill first."""
    buckets: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    current_bytes = 0
    for sharded in reversed(params):
        param = sharded.param
        size = param.numel() * param.element_size()
        kind_changed = current and (param.dtype, param.device) != (current[0].param.dtype, current[0].param.device)
        if current and (kind_changed or current_bytes + size > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(sharded)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def _give_masters(
    sharded: list[ShardedParam], dtype: torch.dtype | None, placement: Placement, mesh: DeviceMesh
) -> None:
    """Separate master copies where the placement puts them (another dtype, another device); on another device the
    reducer gives each a buffer there for its gradient."""
    masters = placement.masters([s.local for s in sharded], dtype)
    master_mesh = placement.master_mesh(mesh)
    for param, master in zip(sharded, masters, strict=True):
        if master is not param.local:
            param.use_master(master, master_mesh)


class EngineState(Enum):
    """Whether the engine is hooked into the module's backward."""

    ATTACHED = auto()  # reducing gradients during backward
    DETACHED = auto()  # hooks removed after training; the sharded layout stays readable for checkpoints


class ZeroEngine:
    """Owns the sharded view of one module for stages 1 and 2.

    Every trainable parameter gets a :class:`ShardedParam`; buckets group them for communication; the stage's
    ``reducer`` reduces gradients during backward; after each optimizer step the gatherer rebuilds full parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        reducer_cls: type[GradientReducer],
        mesh: DataParallelMesh,
        bucket_bytes: int,
        precision: EnginePrecision | None = None,
        placement: Placement | None = None,
        wire: Wire = EXACT,
    ) -> None:
        self.group: ProcessGroup = mesh.shard_group
        shard_size = self.group.size()
        precision = precision or EnginePrecision()
        self.placement = placement or OnDevice()
        trainable = [p for p in module.parameters() if p.requires_grad]  # module.parameters() dedups tied weights
        self.sharded = [ShardedParam(p, ShardSpec(p.shape, shard_size), mesh.shard) for p in trainable]
        _give_masters(self.sharded, precision.master_dtype, self.placement, mesh.shard)
        self.by_param = {id(s.param): s for s in self.sharded}
        buckets = assign_buckets(self.sharded, bucket_bytes)
        self.pool = BufferPool()
        # the shard group sees every shard; replicas hold the same reduced gradients, so they vote alike
        self.scaler = LossScaler(self.group) if precision.loss_scaling else None
        self.reducer = reducer_cls(buckets, mesh, self.pool, precision.reduce_dtype, self.scaler, wire=wire)
        self.gatherer = ParamGatherer(buckets, self.group, self.pool)
        self.state = EngineState.ATTACHED

    def shard_optimizer(self, optimizer: Optimizer) -> ZeroOptimizer:
        """Wrap ``optimizer`` so that it steps on the shards of the module parameters it was built with."""
        check_built_on(optimizer, self.by_param)
        return ZeroOptimizer(
            optimizer,
            self.by_param,
            self.reducer.grad_home,
            self.gatherer.gather,
            self.scaler,
            choose_kernels=self.placement.shard_kernels,
        )

    # --- what it holds beyond the module and the optimizers (a ``lightning_zero.memory.BufferHolder``) --------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        return self.reducer.kept_buffers()

    def master_weights(self) -> list[torch.Tensor]:
        return [s.master for s in self.sharded if s.has_master]

    def communication_bytes(self) -> int:
        return self.pool.nbytes()

    def with_masters(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``module``'s ``state`` dict with each sharded parameter replaced by the DTensor over this rank's master
        (the fp32 one where there is one): what a checkpoint holds and loads into."""
        for name, param in module.named_parameters(remove_duplicate=False):
            sharded = self.by_param.get(id(param))
            if sharded is not None and name in state:
                state[name] = sharded.wrap(sharded.master)
        return state

    def module_from_masters(self) -> None:
        """Make the module's full parameters current from every rank's masters (after loading into them)."""
        with_master = [s for s in self.sharded if s.has_master]
        if with_master:
            torch._foreach_copy_([s.local for s in with_master], [s.master for s in with_master])
        self.gatherer.gather()

    def masters_from_module(self) -> None:
        """Make the masters current from the module (after loading whole tensors into it)."""
        with_master = [s for s in self.sharded if s.has_master]
        if with_master:
            torch._foreach_copy_([s.master for s in with_master], [s.local for s in with_master])

    def detach(self) -> None:
        """No more hooks, no retained communication buffers; the shards still describe the module's layout."""
        self.reducer.remove_hooks()
        self.pool.clear()
        self.state = EngineState.DETACHED
