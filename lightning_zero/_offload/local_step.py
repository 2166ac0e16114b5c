"""An elementwise optimizer's step on the local tensors of its DTensor shards, with its state kept as DTensors.

Every stage hands the optimizer each parameter as its shard, a DTensor (``Shard(0)`` rows, or ``Replicate``), and
that is what users and checkpoints see, state included. Stepping on DTensors sends each operation of the update
through DTensor's dispatch: one per parameter and operation for torch's per-parameter loop, one per operation and
list for the multi-tensor kernels, each costing far more host time than the arithmetic on small and mid-sized
shards. An optimizer whose update of an element reads only that element's gradient and state (:data:`ELEMENTWISE`)
computes the same numbers on the local tensors alone, so the step runs there: plain tensors in the groups, their
state the local tensors of the DTensor state, nothing dispatched through DTensor. Optimizers that reduce over a
parameter (a trust ratio's norms, factored moments) keep stepping on DTensors, whose reductions see the whole
parameter.

Vocabulary:

- **shard**: a parameter the optimizer holds, a DTensor over this rank's rows (a plain tensor, a frozen or replicated
  parameter of stage 3, steps as it is).
- **alias**: a plain tensor over the shard's local tensor, made once and kept while that local tensor stays the
  shard's; it is what the groups hold during a step, with the local tensor of the shard's gradient as its gradient.
- **local state**: the optimizer's state during a step, keyed by alias, each entry the local tensor of the shard's
  DTensor entry (the same memory, so an in-place update is the shard's). An entry the step creates (the first step,
  say) becomes the shard's as a DTensor laid out like it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero._stage3.seam import dtensor_like, local_tensor

# torch's optimizers whose update is elementwise given each element's gradient and state (and scalars per parameter:
# the step count). Exact types: a subclass may override the update.
ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
_SCALAR_ENTRIES = frozenset({"step", "mu_product", "eta", "mu"})  # per parameter, not per element, in ELEMENTWISE


def steps_locally(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s step gives the same numbers on the shards' local tensors (see the module)."""
    return type(optimizer) in ELEMENTWISE


class _Alias:
    """A shard's alias and the state views that go with it, remembered between steps."""

    __slots__ = ("local", "local_state", "local_values", "plain", "shard_state", "shard_values")

    def __init__(self, shard: DTensor) -> None:
        self.local = local_tensor(shard)  # the shard's local tensor this alias was made from
        self.plain = self.local.detach()  # 1D or N-D: the local rows, the same memory
        self.shard_state: dict[str, Any] | None = None  # the DTensor state these views were made from
        self.shard_values: tuple[Any, ...] = ()
        self.local_state: dict[str, Any] | None = None  # its local views, as the step last left them
        self.local_values: tuple[Any, ...] = ()

    def forget_state(self) -> None:
        self.shard_state, self.shard_values, self.local_state, self.local_values = None, (), None, ()


class Views(Enum):
    """Whether the local views of the optimizer state outlive a step."""

    KEPT = auto()  # made once and checked at each step: the state stays where it is between steps
    PER_STEP = auto()  # made at each step and let go after it: the state moves after each step (into files), and
    # views kept would hold its old memory


class _Plan:
    """What the groups and the state held during the last step, kept for the next while the optimizer's groups,
    its state and each shard's storage are the objects they were: a steady step then only hands over the gradients
    (on the order of ten list operations over the parameters, rather than several calls per parameter)."""

    __slots__ = ("groups", "local_state", "local_values", "plain_groups", "shard_state", "shard_values", "stepped")

    def __init__(self, groups: list[list[torch.Tensor]], shard_state: dict[torch.Tensor, Any]) -> None:
        self.groups = [tuple(params) for params in groups]  # the shards, as the groups held them
        self.shard_state = shard_state
        self.stepped: list[tuple[torch.Tensor, torch.Tensor, _Alias | None]] = []  # (shard, what steps, its alias)
        self.plain_groups: list[list[torch.Tensor]] = []
        self.local_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self.shard_values: list[Any] = []  # every shard's state dict, then every value in it, in ``stepped`` order
        self.local_values: list[Any] = []  # the same of ``local_state``, as the last step left it

    def holds(self, groups: list[list[torch.Tensor]], shard_state: dict[torch.Tensor, Any]) -> bool:
        return (
            shard_state is self.shard_state
            and len(groups) == len(self.groups)
            and all(_same(now, then) for now, then in zip(groups, self.groups, strict=True))
            and all(alias is None or local_tensor(shard) is alias.local for shard, _, alias in self.stepped)
            and _same(_state_values(shard_state, self.stepped), self.shard_values)
        )


def _state_values(state: dict[torch.Tensor, Any], stepped: list[tuple[torch.Tensor, torch.Tensor, Any]]) -> list[Any]:
    """Each entry's state dict and the values in it, flat (``get``: a defaultdict makes no entry)."""
    values: list[Any] = []
    for tensor, *_ in stepped:
        entry = state.get(tensor)
        values.append(entry)
        if entry is not None:
            values.extend(entry.values())
    return values


def _local_values(
    local_state: dict[torch.Tensor, Any], stepped: list[tuple[torch.Tensor, torch.Tensor, Any]]
) -> list[Any]:
    return _state_values(local_state, [(stepping, None) for _, stepping, _ in stepped])


class LocalStep:
    """Runs an elementwise optimizer's step on its shards' local tensors (see the module). Holds no optimizer: it
    lives beside one (a weak mapping or its wrapper), and the optimizer's groups and state are read at each step, so
    that loading a checkpoint (which replaces them) needs nothing of it."""

    def __init__(self, views: Views = Views.KEPT) -> None:
        self._aliases: dict[int, tuple[DTensor, _Alias]] = {}  # by the shard's ``id``; the shard keeps the id its own
        self._views = views
        self._plan: _Plan | None = None  # the last step's, while ``views`` keeps them

    @contextmanager
    def applied(self, optimizer: Optimizer) -> Generator[None, None, None]:
        """While in the context, ``optimizer``'s groups hold plain tensors and its state their local views; a step
        taken inside updates the shards and their state in place."""
        groups = [group["params"] for group in optimizer.param_groups]
        shard_state = optimizer.state
        plan = self._plan
        if plan is None or not plan.holds(groups, shard_state):
            plan = self._make_plan(groups, shard_state)
        for shard, stepping, alias in plan.stepped:
            if alias is not None:
                grad = shard.grad
                stepping.grad = None if grad is None else local_tensor(grad)
        for group, plain in zip(optimizer.param_groups, plan.plain_groups, strict=True):
            group["params"] = plain
        optimizer.state = plan.local_state
        try:
            yield
        finally:
            optimizer.state = shard_state
            for group, params in zip(optimizer.param_groups, groups, strict=True):
                group["params"] = params
            for _, stepping, alias in plan.stepped:
                if alias is not None:
                    stepping.grad = None
            self._after_step(plan)

    def _make_plan(self, groups: list[list[torch.Tensor]], shard_state: dict[torch.Tensor, Any]) -> _Plan:
        plan = _Plan(groups, shard_state)
        for params in groups:
            plain = []
            for param in params:
                alias = self._alias(param) if isinstance(param, DTensor) else None
                stepping = param if alias is None else alias.plain
                state = shard_state.get(param)
                if state is not None:
                    plan.local_state[stepping] = state if alias is None else _local_views(alias, state)
                plan.stepped.append((param, stepping, alias))
                plain.append(stepping)
            plan.plain_groups.append(plain)
        plan.shard_values = _state_values(shard_state, plan.stepped)
        plan.local_values = _local_values(plan.local_state, plan.stepped)
        return plan

    def _after_step(self, plan: _Plan) -> None:
        """What the step created or replaced becomes the shards' state; the plan is kept where nothing was."""
        if self._views is Views.KEPT and _same(_local_values(plan.local_state, plan.stepped), plan.local_values):
            self._plan = plan  # the usual step: every entry updated in place
            return
        shard_state = plan.shard_state
        for shard, stepping, alias in plan.stepped:
            _keep_new_state(shard_state, shard, plan.local_state.get(stepping), alias)
            if alias is not None and self._views is Views.PER_STEP:
                alias.forget_state()
        self._plan = None

    @contextmanager
    def around_step(self, optimizer: Optimizer) -> Generator[None, None, None]:
        """While in the context, ``optimizer.step(closure)`` runs the closure as it is (forward, backward, a
        precision plugin's clipping: all on the shards), then the update inside :meth:`applied`."""
        original = optimizer.step
        shadowed = "step" in optimizer.__dict__  # an instance attribute: an LR scheduler's wrapper, say

        def local(closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with self.applied(optimizer):
                original()
            return loss

        optimizer.step = local  # type: ignore[method-assign]
        try:
            yield
        finally:
            if shadowed:
                optimizer.step = original  # type: ignore[method-assign]
            else:
                del optimizer.step

    def _alias(self, shard: DTensor) -> _Alias:
        kept = self._aliases.get(id(shard))
        if kept is None or kept[0] is not shard or kept[1].local is not local_tensor(shard):
            kept = (shard, _Alias(shard))  # a new shard, or its storage moved (into a file, a loaded copy)
            self._aliases[id(shard)] = kept
        return kept[1]


def _local_views(alias: _Alias, state: dict[str, Any]) -> dict[str, Any]:
    """The local views of ``state`` (a shard's), the same dict as at the last step while no entry was replaced."""
    if alias.shard_state is not state or not _same(alias.shard_values, tuple(state.values())):
        alias.shard_state = state
        alias.shard_values = tuple(state.values())
        alias.local_state = {k: local_tensor(v) if isinstance(v, DTensor) else v for k, v in state.items()}
        alias.local_values = tuple(alias.local_state.values())
    assert alias.local_state is not None
    return alias.local_state


def _keep_new_state(
    shard_state: defaultdict[torch.Tensor, dict[str, Any]],
    shard: torch.Tensor,
    local: dict[str, Any] | None,
    alias: _Alias | None,
) -> None:
    """After a step: what the step created or replaced in ``local`` (the state of ``shard``'s alias) becomes
    ``shard``'s, entries shaped like the alias as DTensors laid out like the shard."""
    if local is None:
        return
    if alias is None:  # a plain parameter's state dict is its own
        shard_state[shard] = local
        return
    if local is alias.local_state and _same(tuple(local.values()), alias.local_values):
        return  # the usual step: every entry updated in place
    assert isinstance(shard, DTensor)
    state = shard_state[shard]
    for key, value in local.items():
        if isinstance(state.get(key), DTensor) and local_tensor(state[key]) is value:
            continue
        like = isinstance(value, torch.Tensor) and value.shape == alias.plain.shape and key not in _SCALAR_ENTRIES
        state[key] = dtensor_like(shard, value) if like else value
    alias.shard_state = state
    alias.shard_values = tuple(state.values())
    alias.local_state = local
    alias.local_values = tuple(local.values())


def _same(these: Sequence[Any], those: Sequence[Any]) -> bool:
    """The same objects, one for one (``==`` on tensors would compare their values)."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those, strict=True))
