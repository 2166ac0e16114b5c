"""Stage 3 on the package's engine: the module holds only this rank's rows of each parameter; a unit is gathered for
its forward and again for its backward (unless kept between them: ``keep_for_backward``), and released after each;
gradients are reduce-scattered by the stage-2 reducer, a bucket per unit or per run of small consecutive units.

The hooks, per unit (see :mod:`.units` for the words):

- before its forward: gather it (if released) and let its modules hold the whole parameters; with gradients on,
  mark its inputs so that its release follows its backward (:class:`_ReleaseAfterBackward`);
- after its forward: its modules hold the shards again and a unit but the root is released, unless it is one of
  the last units of the previous step's forward kept for backward; with gradients on, a hook on its outputs gathers
  it again (if released) when backward reaches them, its modules holding the whole parameters until it is released.
  The root stays gathered through the step: a step runs as the root's forward
  (:meth:`Stage3Engine.run_as_forward`), whatever it calls;
- in backward: when the backward of the unit's inputs is done, its gradients are staged into its bucket together,
  and the bucket is reduce-scattered once every unit sharing it is done
  (:class:`~lightning_zero._engine.reducers.ReduceScatterReducer`), and the unit is released; at the end of backward
  every unit still gathered (the root, units whose inputs needed no gradient) is.

Recomputed forwards (activation checkpointing) run during backward: they gather where needed and release nothing,
the backward that follows them does. A unit's modules hold the whole parameters from its gather to its release, at
rest the shards. Every rank gathers the units in the same order, each collective labelled with
its unit (:mod:`lightning_zero._transport.labels`), and the ranks meet at the end of each forward of the whole module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from lightning_zero._engine.engine import EnginePrecision
from lightning_zero._engine.layout import ShardSpec
from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.pool import BufferPool
from lightning_zero._engine.reducers import ReduceScatterReducer
from lightning_zero._engine.sharded_param import ShardedParam
from lightning_zero._stage3.collectives import open_gather_ring
from lightning_zero._stage3.seam import mark_sharded
from lightning_zero._stage3.units import Unit, UnitState
from lightning_zero._transport import activity, labels, shared_memory
from lightning_zero._transport.mesh import DataParallelMesh, Split
from lightning_zero._transport.quantized import EXACT, Wire, spans_hosts


class Phase(Enum):
    """Where the module is within a step."""

    IDLE = auto()  # between steps, or in a forward
    BACKWARD = auto()  # backward has started: forwards now are recomputations


class _ReleaseAfterBackward(torch.autograd.Function):
    """The identity on a unit's inputs, whose backward (the unit's backward done) releases the unit."""

    @staticmethod
    def forward(ctx: Any, release: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.release = release
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.release()
        return (None, *grads)


class Stage3Engine:
    """Shards ``module``'s parameters into ``units`` (deepest first; the module itself is the root, last) and runs the
    hooks the module docstring describes. With ``precision``'s master dtype, 16-bit parameters are kept (and stepped)
    in it and gathered in their own. 0-dim parameters are replicated: every rank keeps all of each, in the dtype the
    optimizer steps in."""

    def __init__(
        self,
        module: nn.Module,
        units: list[nn.Module],
        mesh: DataParallelMesh,
        device: torch.device,
        precision: EnginePrecision | None = None,
        keep_for_backward: int = 0,
        wire: Wire = EXACT,
        secondary: Split | None = None,
    ) -> None:
        self.mesh = mesh
        self.wire = wire  # what crosses between nodes quantized (ZeRO++)
        self.keep_for_backward = keep_for_backward  # bytes of whole parameters kept from forward to backward
        self.precision = precision or EnginePrecision()
        store_dtype = _kept_dtypes(self.precision.master_dtype)
        self.group = mesh.shard_group
        self.pool = BufferPool()
        self.replicated = [p for p in module.parameters() if p.dim() == 0]
        paths = {m: path for path, m in module.named_modules()}
        kind = self._kind = type(module).__name__
        self.units: list[Unit] = []
        quantize = wire.weights and spans_hosts(self.group, wire.ranks_per_node)
        taken = {id(p) for p in self.replicated}
        for unit_module in [*units, module]:
            params = [p for p in unit_module.parameters() if id(p) not in taken]
            taken.update(id(p) for p in params)
            path = paths[unit_module]
            self.units.append(
                Unit(path, unit_module, params, store_dtype, self.group, mesh.shard, device,
                     labels.unit_gather(kind, path), quantize, secondary)
            )  # fmt: skip
        for param in self.replicated:  # in the dtype the optimizer steps in: no gather casts them
            param.data = param.data.to(device, store_dtype.get(param.dtype, param.dtype))
        self.replicated_sharded = [ShardedParam(p, ShardSpec(p.shape, self.group.size()), mesh.shard)
                                   for p in self.replicated]  # fmt: skip
        self.root = self.units[-1]
        for unit in self.units:  # released from the start: the modules hold the shards
            unit.hold_shards()
        self.phase = Phase.IDLE
        self.reducer: ReduceScatterReducer | None = None  # with the optimizers
        self._forwards = 0  # forwards of the whole module under way
        self._ran: list[Unit] = []  # units whose forward with gradients ended in this step, in order
        self._kept: set[Unit] = set()  # units kept gathered from their forward to their backward in this step
        self._channel = shared_memory.channel(self.group) if self.group.size() > 1 else None
        if self._channel is not None:  # a unit's ranks then write their rows into one shared buffer, read in place
            # the root, gathered once a step, larger than every unit (embeddings, a head), goes through the slots
            open_gather_ring(self._channel, max(unit.gathered_bytes for unit in self.units[:-1] or self.units))
        for unit, unit_module in zip(self.units, [*units, module], strict=True):
            unit_module.register_forward_pre_hook(self._before_forward(unit), with_kwargs=True)
            unit_module.register_forward_hook(self._after_forward(unit))
        mark_sharded(module)

    # --- what the optimizers step on ------------------------------------------------------------------------------

    @property
    def sharded(self) -> list[ShardedParam]:
        """Every parameter as its shard: the units', then the replicated ones."""
        return [s for unit in self.units for s in unit.sharded] + self.replicated_sharded

    def by_param(self) -> dict[int, ShardedParam]:
        """Each parameter's :class:`ShardedParam` by the ``id`` of what the module holds at rest (a shard, or a
        replicated parameter itself)."""
        held = {id(s.shard): s for unit in self.units for s in unit.sharded}
        held.update({id(s.param): s for s in self.replicated_sharded})
        return held

    def reduce_gradients(
        self, reduce_dtype: torch.dtype | None, scaler: LossScaler | None, bucket_bytes: int
    ) -> ReduceScatterReducer:
        """Start reducing the gradients of the parameters trained now, in the order backward reaches the units (the
        root, gathered first in forward, last), then the replicated ones. Consecutive units share a bucket while
        their gradients, in the dtype they are reduced in, fit in ``bucket_bytes`` together: small units then meet
        their peers once for several (a unit larger than that has a bucket of its own)."""
        if self.reducer is None:
            buckets: list[list[ShardedParam]] = []
            fill = 0  # bytes in the last bucket of units
            for unit in reversed(self.units[:-1]):  # staged whole as each unit's backward ends
                trained = [s for s in unit.sharded if s.param.requires_grad]
                unit.bucket, unit.bucket_indices = None, range(0)
                if not trained:
                    continue
                size = sum(s.spec.padded_numel * (reduce_dtype or s.param.dtype).itemsize for s in trained)
                joins = fill > 0 and fill + size <= bucket_bytes and _one_dtype(buckets[-1] + trained, reduce_dtype)
                if not joins:
                    buckets.append([])
                    fill = 0
                unit.bucket = len(buckets) - 1
                unit.bucket_indices = range(len(buckets[-1]), len(buckets[-1]) + len(trained))
                buckets[-1].extend(trained)
                fill += size
            whole = range(len(buckets))
            for rest in (self.root.sharded, self.replicated_sharded):  # staged gradient by gradient
                trained = [s for s in rest if s.param.requires_grad]
                if trained:
                    buckets.append(trained)
            self.reducer = ReduceScatterReducer(
                buckets, self.mesh, self.pool, reduce_dtype, scaler, whole=whole, wire=self.wire
            )
            for unit in self.units[:-1]:  # a bucket's collective is named after the first unit backward reaches
                if unit.bucket is not None and unit.bucket_indices.start == 0:
                    self.reducer.buckets[unit.bucket].label = labels.unit_reduce(self._kind, unit.path)
        return self.reducer

    # --- what it holds beyond the module and the optimizers (a ``lightning_zero.memory.BufferHolder``) --------------

    def gradient_buffers(self) -> list[torch.Tensor]:
        return [] if self.reducer is None else self.reducer.kept_buffers()

    def master_weights(self) -> list[torch.Tensor]:
        return []  # the shards are the masters

    def communication_bytes(self) -> int:
        return self.pool.nbytes()

    # --- the hooks ------------------------------------------------------------------------------------------------

    def _before_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if unit is self.root:
                self._forwards += 1
            backward_comes = unit is not self.root and torch.is_grad_enabled() and self.phase is Phase.IDLE
            if self.phase is Phase.IDLE:  # a secondary copy left by a forward whose backward never came may be stale
                unit.drop_secondary()
            unit.gather(self.pool, self._channel, keep_secondary=backward_comes and unit not in self._kept)
            unit.hold_whole()
            if backward_comes:
                unit.forwards += 1
                args, kwargs = _released_after_backward(self._backward_done(unit), args, kwargs)
            return args, kwargs

        return hook

    def _after_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if unit is self.root:
                self._forwards -= 1
                if self._forwards > 0:  # a forward of the whole module inside a step: the root stays as it is
                    return
            if self.phase is Phase.BACKWARD:  # a recomputation: its backward comes next, gathered
                return
            training = torch.is_grad_enabled()
            if training:
                _before_backward_of(output, self._backward_reaches(unit))
            if unit is self.root:
                unit.hold_shards()
                self._end_of_forward()
            elif training:
                self._ran.append(unit)
                if unit in self._kept:  # its backward comes soon: kept whole, its modules holding the shards
                    unit.hold_shards()
                else:
                    unit.release()
            else:
                unit.release()

        return hook

    def _backward_reaches(self, unit: Unit) -> Callable[[Any], None]:
        def hook(_: Any) -> None:
            if self.phase is Phase.IDLE:
                self.phase = Phase.BACKWARD
                Variable._execution_engine.queue_callback(self._end_of_backward)
                if self.reducer is not None:  # units run twice stage their gradients only at the end
                    self.reducer.backward_started()
            unit.gather(self.pool, self._channel)
            unit.hold_whole()  # a recomputation (activation checkpointing) may call its forward directly

        return hook

    def _backward_done(self, unit: Unit) -> Callable[[], None]:
        def done() -> None:
            """The backward of the unit's inputs is done: its gradients are all accumulated, unless it ran more than
            one forward in this step (the others' backward may still add to them: the end of backward stages them)."""
            if self.reducer is not None and unit.bucket is not None and unit.forwards == 1:
                self.reducer.accumulated(unit.bucket, unit.bucket_indices)
            unit.release()

        return done

    def _end_of_forward(self) -> None:
        """Every rank meets the others at the end of the outermost forward of the whole module. The units the next
        step keeps for backward are chosen: the last to run in this one, whose backward comes first, while their whole
        parameters fit in ``keep_for_backward`` together."""
        if self._ran:  # a forward with gradients (an evaluation's leaves the choice as it was)
            self._kept, room = set(), self.keep_for_backward
            for unit in reversed(self._ran):
                room -= unit.whole_bytes
                if room < 0:
                    break
                self._kept.add(unit)
            self._ran = []
        activity.entered(labels.END_OF_FORWARD)
        if self._channel is not None:
            self._channel.meet(labels.END_OF_FORWARD)

    def _end_of_backward(self) -> None:
        for unit in self.units:
            unit.release()
            unit.drop_secondary()
            unit.forwards = 0
        self.phase = Phase.IDLE

    # --- around steps ---------------------------------------------------------------------------------------------

    def run_as_forward(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward`` (a step of the LightningModule, called as the root's forward)."""
        return forward()

    def at_rest(self) -> None:
        """Every unit released, the modules holding the shards (after an evaluation, the root stays gathered)."""
        for unit in self.units:
            unit.release()
            unit.drop_secondary()

    def after_step(self) -> None:
        """The optimizer updated the shards: a unit still gathered is released, and the root, inside a step that
        steps the optimizer itself (manual optimization), gathered again with the new values."""
        for unit in self.gathered:
            unit.release()
        if self._forwards > 0:
            self.root.gather(self.pool)
            self.root.hold_whole()

    def settle(self) -> None:
        """After an exception aborted a step: every unit at rest, the step's gradient reduction abandoned."""
        self._forwards = 0
        self.phase = Phase.IDLE
        self.at_rest()
        if self.reducer is not None:
            self.reducer.abandon()

    @property
    def gathered(self) -> list[Unit]:
        return [u for u in self.units if u.state is UnitState.GATHERED]


def _kept_dtypes(master: torch.dtype | None) -> dict[torch.dtype, torch.dtype]:
    """What each parameter dtype is kept in: ``master`` for 16-bit ones, with master weights."""
    if master is None:
        return {}
    return {dtype: master for dtype in (torch.float16, torch.bfloat16) if dtype != master}


def _one_dtype(params: list[ShardedParam], reduce_dtype: torch.dtype | None) -> bool:
    """Whether ``params`` reduce in one dtype: ``reduce_dtype``, else their own."""
    return reduce_dtype is not None or len({s.param.dtype for s in params}) == 1


def _tensors_needing_grad(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested in tuples, lists and mappings) that autograd will reach."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_needing_grad(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors_needing_grad(item)]
    return []


def _before_backward_of(output: Any, hook: Callable[[Any], None]) -> None:
    """``hook`` runs once backward reaches any tensor of ``output``."""
    tensors = _tensors_needing_grad(output)
    if len(tensors) == 1:  # the usual case, and a tenth of the cost of a hook on several
        tensors[0].register_hook(hook)
    elif tensors:
        register_multi_grad_hook(tensors, hook, mode="any")


def _released_after_backward(
    release: Callable[[], None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The unit's inputs (top-level tensors) passed through :class:`_ReleaseAfterBackward`; a unit whose inputs need
    no gradient is released at the end of backward."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions and not names:
        return args, kwargs
    marked = _ReleaseAfterBackward.apply(release, *(args[i] for i in positions), *(kwargs[k] for k in names))
    new_args = list(args)
    for i, tensor in zip(positions, marked, strict=False):
        new_args[i] = tensor
    new_kwargs = dict(kwargs)
    for k, tensor in zip(names, marked[len(positions) :], strict=True):
        new_kwargs[k] = tensor
    return tuple(new_args), new_kwargs
