"""What every stage-3 mode shares: modules built without memory, optimizers built before sharding moved to the
shards, evaluation loops of the same length on every rank, a loss that is not a shard."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero._core.mode import Mode
from lightning_zero._stage3.meta_init import MetaInit
from lightning_zero._stage3.step import check_even_batches, check_plain_loss


class ParametersMode(Mode):
    """A stage-3 mode: the module's parameters become shards at set-up (see the subclasses for how they are
    gathered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meta_init = MetaInit()
        # before sharding, each parameter's name: optimizers built on the unsharded module are moved to its shards
        self._names: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}

    def sibling(self) -> Mode:
        """Modules built together under one ``init_context`` share the record of their meta parameters."""
        other = super().sibling()
        assert isinstance(other, ParametersMode)
        other.meta_init = self.meta_init
        return other

    def init_context(self, empty_init: bool) -> AbstractContextManager[None]:
        """Parameters are built without memory, recording what gives them their values, and get those values after
        sharding (see :mod:`lightning_zero._stage3.meta_init`), unless ``empty_init`` is false."""
        return self.meta_init() if empty_init else nullcontext()

    def _remember_names(self, module: nn.Module) -> None:
        """Before sharding: each parameter's name, for optimizers built on the module as it is now."""
        self._names = {id(p): (weakref.ref(p), n) for n, p in module.named_parameters(remove_duplicate=False)}

    def _adopt_shards(self, module: nn.Module, optimizer: Optimizer) -> None:
        """An optimizer built on the module before sharding (Fabric's ``setup(model, optimizer)``) holds parameters
        the shards have replaced: point it at their shards, by name."""
        shards = dict(module.named_parameters(remove_duplicate=False))
        current = {id(p) for p in shards.values()}
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if id(param) in current:
                    continue
                name = self._name_before_sharding(param)
                if name not in shards:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} that is not a"
                        " parameter of the module being set up. HINT: build the optimizer from that module's"
                        " `parameters()`."
                    )
                if optimizer.state:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} already holds state for the unsharded parameters."
                        " HINT: set it up before its first step; load its state through a checkpoint."
                    )
                group["params"][index] = shards[name]

    def updates(self, module: nn.Module, optimizer: Optimizer) -> bool:
        """Built on the module's shards, or on its parameters before sharding."""
        if super().updates(module, optimizer):
            return True
        params = (p for group in optimizer.param_groups for p in group["params"])
        return any(self._name_before_sharding(p) is not None for p in params)

    def _name_before_sharding(self, param: torch.Tensor) -> str | None:
        """The name ``param`` had in the module before sharding replaced it, if it was one of its parameters (the id
        alone could be a later tensor's)."""
        ref, name = self._names.get(id(param), (None, ""))
        return name if ref is not None and ref() is param else None

    def check_loss(self, loss: torch.Tensor) -> None:
        check_plain_loss(loss)

    def before_evaluation(self, counts: list[float], loop: str) -> None:
        group = self._sync_group
        if group is not None:
            check_even_batches(counts, loop, group)
