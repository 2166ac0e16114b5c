"""The interface of the ZeRO core: a *mode* trains one module with its optimizers in one way.

Vocabulary:

- **mode**: how this run trains, chosen once per strategy by :func:`choose_mode` from the options and the number of
  ranks: :class:`~lightning_zero._core.plain.PlainMode` (one device, nothing to shard),
  :class:`~lightning_zero._core.engine.EngineMode` (stages 1 and 2: full parameters in the module, optimizer state
  and, in stage 2, gradients sharded by the package's engine) or
  :class:`~lightning_zero._core.fully_shard.FullyShardMode` (stage 3: parameters sharded too, by ``fully_shard``).
- **front end**: the Trainer strategy (:mod:`lightning_zero.pytorch`) or the Fabric strategy
  (:mod:`lightning_zero.fabric`). It turns Lightning's hooks into the calls below, in the order they come:
  ``init_context`` around the module's construction; ``setup_module``; ``setup_optimizers``; then for each step
  ``before_step`` (Fabric: before every forward), ``run_step`` (Trainer only), ``no_sync`` around the backward passes
  of an accumulation window but the last, ``check_loss``, ``after_backward`` and ``optimizer_step``;
  ``before_evaluation`` before an evaluation loop and ``at_rest`` when a loop ends (Trainer only); the state calls
  for checkpoints, through :class:`~lightning_zero._core.checkpointed.Checkpointed`; ``settle_after_failure`` after
  an exception (Trainer only); ``teardown``. Fabric sets up several modules, each with a mode of its own
  (:meth:`Mode.sibling`).
- **at rest**: the module holds exactly what the optimizers update (stage 3's gathered units freed), which is what
  checkpoints name.
- **life cycle**: :class:`LifeCycle`, moved by ``setup_module``, ``setup_optimizers`` and ``teardown`` alone; a
  call that means nothing yet (``no_sync`` before the optimizers exist, say) does nothing.
- **placement**: where the optimizer's side of training lives (:mod:`lightning_zero._offload.placement`), chosen
  beside the mode; a mode asks it and never reads the offload options itself.

A mode never changes the front end's objects: it returns what they need (the optimizers as they step, the
:attr:`Mode.loss_scaler` the precision plugin multiplies the loss by, the :attr:`Mode.buffers` the memory report
counts) and the front end puts them where they go.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from enum import Enum, auto
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_zero._checkpoint.live import OptimizerEntries
from lightning_zero._config import ZeroConfig
from lightning_zero._core.optimizers import as_set_up, check_configured, unwrap
from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._offload.placement import Placement
from lightning_zero._transport import collectives as comm
from lightning_zero._transport import peers
from lightning_zero._transport.c10d_private import sync_module_states
from lightning_zero._transport.mesh import DataParallelMesh, Split, data_parallel_mesh, shard_group_size, split
from lightning_zero._transport.quantized import Wire, spans_hosts
from lightning_zero._transport.traffic import TRAFFIC
from lightning_zero._wrap import apply_activation_checkpointing
from lightning_zero.memory import BufferHolder

_BufferSlot = tuple[dict[str, torch.Tensor | None], str]  # (the owning module's buffer dict, the name)


class LifeCycle(Enum):
    """Where a mode is between the front end's calls."""

    NEW = auto()  # no module set up yet
    PLACED = auto()  # the module is placed as the mode trains it (stage 3: sharded); no optimizers (evaluation)
    TRAINING = auto()  # the optimizers are set up: gradients are reduced during backward, steps run
    TORN_DOWN = auto()  # after training: checkpoints are still written and read, nothing is reduced


class Mode:
    """One way of training a module and its optimizers on this run's ranks; see the module's vocabulary."""

    #: whether the module keeps Lightning's ``SyncBatchNorm`` layers after training (stage 3: ``fully_shard``
    #: manages their parameters, and swapping the layers back would leave the parameters on modules it no longer sees)
    keeps_sync_batchnorm: ClassVar[bool] = False
    #: whether the mode scales the loss itself where a precision plugin's ``GradScaler`` would (fp16 gradients in
    #: shards: the scaler would look only at this rank's shards for overflows); the front end takes the scaler away
    replaces_grad_scaler: ClassVar[bool] = False

    def __init__(self, config: ZeroConfig, placement: Placement, ranks_per_node: int = 1) -> None:
        self.config = config
        self.placement = placement  # where masters, gradient shards, optimizer state and the step live
        self.ranks_per_node = ranks_per_node  # for ``shard_group_size="node"``
        self.device = torch.device("cpu")  # set by ``setup_module``
        self.state = LifeCycle.NEW
        self._buffers_due = True  # whether the next step starts by broadcasting rank 0's buffers
        self._buffer_slots: tuple[weakref.ref[nn.Module], list[_BufferSlot]] | None = None  # see ``_buffers``

    # --- construction and setup ---------------------------------------------------------------------------------

    def sibling(self) -> Mode:
        """A mode like this one for another module of the same run (Fabric sets up several): its own module, units
        and buckets, the same options and placement."""
        return type(self)(self.config, self.placement, self.ranks_per_node)

    def init_context(self, empty_init: bool) -> AbstractContextManager[None]:
        """Around the module's construction (``configure_model``, ``init_module``)."""
        return nullcontext()

    def setup_module(self, module: nn.Module, device: torch.device) -> None:
        """Before the optimizers exist: activation checkpointing, then the module's place on ``device``."""
        self.device = device
        TRAFFIC.ranks_per_node = self.ranks_per_node
        peers.witness_timeouts()  # until teardown
        if self.config.activation_checkpointing is not None:
            apply_activation_checkpointing(module, self.config.activation_checkpointing)
        self._place(module)
        self.state = LifeCycle.PLACED
        self._buffers_due = True

    def _place(self, module: nn.Module) -> None:
        """Put the module on ``self.device`` as this mode trains it, every rank starting from rank 0's weights."""
        raise NotImplementedError

    def setup_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], *, grad_scaler_taken: bool = False
    ) -> list[Optimizer]:
        """The optimizers ``configure_optimizers`` (or the user) built on ``module``'s parameters, as they step here.
        ``grad_scaler_taken``: the front end took its precision plugin's ``GradScaler`` away (see
        :attr:`replaces_grad_scaler`), so the loss is scaled by :attr:`loss_scaler` instead."""
        for optimizer in optimizers:
            check_configured(optimizer)
        wrapped = self._wrap_optimizers(module, optimizers, grad_scaler_taken)
        self.state = LifeCycle.TRAINING
        return wrapped

    def _wrap_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], grad_scaler_taken: bool
    ) -> list[Optimizer]:
        """What ``setup_optimizers`` returns, after the common checks."""
        raise NotImplementedError

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The loss scaler the precision plugin multiplies the loss by, when the mode scales it."""
        return None

    # --- the step ---------------------------------------------------------------------------------------------------

    @property
    def _sync_group(self) -> ProcessGroup | None:
        """The data-parallel group (every rank, across the shard groups of hybrid sharding), once the mode
        communicates; ``None`` while there is nothing to synchronise."""
        return None

    @property
    def _gradient_sync(self) -> bool:
        """Whether the current backward pass reduces gradients across ranks (not inside ``no_sync``)."""
        return True

    def before_step(self, module: nn.Module) -> None:
        """Broadcast rank 0's buffers when the previous step was a synchronised training step, DDP's exact rule: so
        BatchNorm statistics evolve as they would under ``"ddp"``."""
        group = self._sync_group
        if not self.config.broadcast_buffers or group is None:
            return
        if self._buffers_due:
            with torch.no_grad():
                comm.broadcast_(self._buffers(module), group)
        self._buffers_due = torch.is_grad_enabled() and self._gradient_sync

    def _buffers(self, module: nn.Module) -> list[torch.Tensor]:
        """``module.buffers()``, from where each is registered, found once per module (as DDP finds them once): a
        walk of every submodule at every step is host time a step need not spend. A buffer registered later is not
        broadcast, as under DDP; one assigned anew in its place is."""
        if self._buffer_slots is None or self._buffer_slots[0]() is not module:
            seen: set[int] = set()
            slots = []
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None and id(buffer) not in seen:
                        seen.add(id(buffer))
                        slots.append((owner._buffers, name))
            self._buffer_slots = (weakref.ref(module), slots)  # a dropped module goes
        return [b for buffers, name in self._buffer_slots[1] if (b := buffers.get(name)) is not None]

    def run_step(self, plain: Callable[[], Any], as_forward: Callable[[], Any]) -> Any:
        """Run one step of a LightningModule hook, given two ways to call it: ``plain``, directly, or ``as_forward``,
        as the module's forward."""
        return plain()

    def no_sync(self) -> AbstractContextManager[None]:
        """Around the backward passes of an accumulation window but the last."""
        return nullcontext()

    def check_loss(self, loss: torch.Tensor) -> None:
        """Before backward: refuse a loss that cannot give correct gradients here."""

    def after_backward(self) -> None:
        """After each backward pass."""

    def optimizer_step(self, optimizer: Optimizer, step: Callable[[], Any]) -> Any:
        """Run ``step``, the front end's optimizer step, as the placement steps (host kernels, state moved into its
        files after it)."""
        with self.placement.stepping(unwrap(optimizer)):
            return step()

    def before_evaluation(self, counts: list[float], loop: str) -> None:
        """Before an evaluation loop (``"validation"``, ``"test"``, ``"predict"``) of ``counts`` batches per dataloader
        on this rank (``inf`` where unknown)."""

    def at_rest(self) -> None:
        """Bring the module to rest (see the module's vocabulary)."""

    # --- state: what the mode hands the checkpoint layer (:mod:`lightning_zero._core.checkpointed`) and takes back -

    def model_entries(self, module: nn.Module) -> dict[str, Any]:
        """The module's state dict for a checkpoint, at rest, each sharded parameter the DTensor over this rank's rows
        of what the optimizer updates; the values alias the live tensors, so loading into them loads into the
        module."""
        self.at_rest()
        return module.state_dict()

    def optimizer_entries(self, optimizer: Optimizer) -> OptimizerEntries:
        """The optimizer as set up, and the tensors its state is laid out like."""
        return OptimizerEntries.of(as_set_up(optimizer), self.placement.state_like)

    def after_load(self) -> None:
        """After a checkpoint directory filled the entries: make what depends on them current."""
        self.placement.release()

    def after_save(self) -> None:
        """After a checkpoint was written: what reading the states for it brought into memory can leave."""
        self.placement.release()

    def updates(self, module: nn.Module, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` was built on ``module``'s parameters (this mode placed ``module``)."""
        params = {id(p) for p in module.parameters()}
        return any(id(p) in params for group in as_set_up(optimizer).param_groups for p in group["params"])

    # --- the end ----------------------------------------------------------------------------------------------------

    def settle_after_failure(self) -> None:
        """After an exception aborted a step, before the front end's teardown: bring the module to rest."""

    def teardown(self) -> None:
        """After training: release what only training needs; checkpoints can still be written. Called again (the
        run's end after a front end's teardown) it changes nothing."""
        self.placement.teardown()
        for undo in self.process_undos():
            undo()
        self.state = LifeCycle.TORN_DOWN

    def process_undos(self) -> list[Callable[[], None]]:
        """What ``setup_module`` put into the process (not into the module), undone at teardown and at the run's end
        even once the mode itself is gone (:mod:`lightning_zero._core.run_scope`): here the c10d logger's witness of
        timeouts."""
        return [peers.stop_witnessing_timeouts]

    @property
    def buffers(self) -> BufferHolder | None:
        """What the mode holds beyond the module's parameters and the optimizers' state, for the memory report."""
        return None

    @property
    def shard_size(self) -> int:
        """The ranks of one shard group (all of them, without hybrid sharding)."""
        return shard_group_size(self.config.shard_group_size, dist.get_world_size(), self.ranks_per_node)

    def _mesh(self) -> DataParallelMesh:
        """The shard groups of this run (collective on first use)."""
        return data_parallel_mesh(self.device.type, self.shard_size)

    def _zero_plus_plus(self, mesh: DataParallelMesh) -> tuple[Wire, Split | None]:
        """Collective (where groups are new): what crosses between nodes quantized, and the parts of the shard group
        each unit stays sharded within after its forward (stage 3)."""
        config, per_node = self.config, self.ranks_per_node
        backend = dist.get_backend(mesh.world)
        if (config.quantize_weights or config.quantize_gradients) and backend != "gloo":
            raise ValueError(
                f"`quantize_weights` and `quantize_gradients` run on gloo (CPU ranks) in this release, not on"
                f" {backend!r}. HINT: drop them; hybrid sharding (`shard_group_size='node'`) keeps gathers off the"
                " links between nodes."
            )
        crosses = spans_hosts(mesh.shard_group, per_node)
        by_host = None
        if config.quantize_gradients and crosses:
            if self.shard_size % per_node:
                raise ValueError(
                    f"`quantize_gradients=True` reduces within each node, then across nodes, and the shard groups of"
                    f" {self.shard_size} ranks hold part of a node of {per_node}. HINT: make the shard groups whole"
                    " nodes (`shard_group_size`), or drop `quantize_gradients`."
                )
            by_host = split(self.shard_size, per_node)
        wire = Wire(per_node, config.quantize_weights, config.quantize_gradients, by_host)
        option = config.secondary_group_size
        if option is None:
            return wire, None
        size = per_node if option == "node" else int(option)
        if self.shard_size % size:
            raise ValueError(
                f"`secondary_group_size={option!r}` makes groups of {size} ranks, which do not divide the shard group"
                f" of {self.shard_size}. HINT: pass a divisor of the number of ranks, or 'node'."
            )
        return wire, (split(self.shard_size, size) if size < self.shard_size else None)


_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's bucket size for the initial broadcast of rank 0's weights


def sync_from_rank_zero(module: nn.Module, group: ProcessGroup, skip: set[str] | None = None) -> None:
    """Every rank starts from rank 0's parameters and buffers, as under DDP (except those named in ``skip``)."""
    sync_module_states(module, group, _BROADCAST_BUCKET_BYTES, 0, skip or set())
