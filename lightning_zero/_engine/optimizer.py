"""The optimizer a LightningModule configured, made to step on this rank's shards."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero._engine.loss_scaler import LossScaler, StepVerdict
from lightning_zero._engine.reducers import GradHome
from lightning_zero._engine.sharded_param import ShardedParam
from lightning_zero._offload.kernels import KernelChoice
from lightning_zero._offload.local_step import LocalStep, steps_locally


def check_built_on(optimizer: Optimizer, shards: dict[int, ShardedParam]) -> None:
    """Refuse an optimizer with state already (it would be laid out for whole parameters) or holding a tensor that is
    not one of the module's trainable parameters (``shards``, by ``id``)."""
    if optimizer.state:
        raise RuntimeError(
            f"{type(optimizer).__name__} already holds state before training started."
            " HINT: create optimizers fresh in `configure_optimizers`; load state through a checkpoint."
        )
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and id(param) not in shards:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} that is not a"
                    " trainable parameter of the LightningModule. HINT: build optimizers from"
                    " `self.parameters()` (or a subset of them) in `configure_optimizers`."
                )


class ZeroOptimizer(Optimizer):
    """Wraps a ``torch.optim`` optimizer so that its update runs on this rank's shards only.

    At rest the wrapped optimizer's ``param_groups`` hold the module's own parameters, exactly as
    ``configure_optimizers`` built them, so ``toggle_optimizer``, learning-rate schedulers and anything else that reads
    them keep working. Its ``state`` is keyed by the shards (see :class:`ShardedParam`), which are swapped into the
    groups only while the wrapped optimizer steps or (de)serialises its state.

    ``step`` reads like its docstring: gradients were reduced during backward, so update my shards, then gather
    everyone's updated shards into the full module parameters (``gather``; in stage 3 ``None``: each unit gathers
    them before it runs).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        shards: dict[int, ShardedParam],
        grad_home: GradHome,
        gather: Callable[[set[int]], None] | None,
        scaler: LossScaler | None = None,
        *,
        choose_kernels: Callable[[Optimizer], KernelChoice],
    ) -> None:
        # The base constructor is skipped on purpose: this object owns no parameters of its own.
        self.optimizer = optimizer
        self._grad_home = grad_home
        self._gather = gather
        self._scaler = scaler
        self._module_groups = [list(group["params"]) for group in optimizer.param_groups]
        # the same groups with every sharded parameter replaced by its shard (frozen ones stay as they are)
        self._shard_groups = [[shards[id(p)].shard if id(p) in shards else p for p in ps] for ps in self._module_groups]
        self.sharded = [shards[id(p)] for ps in self._module_groups for p in ps if id(p) in shards]
        self._shard_ids = {id(s.shard) for s in self.sharded}
        with self.shards_installed():
            self._kernels = choose_kernels(optimizer)  # the placement's: decided once, on the shards
        self._local = LocalStep() if steps_locally(optimizer) else None  # else it steps on the DTensor shards
        with_master = [s for s in self.sharded if s.has_master]
        self._module_rows = [s.local for s in with_master]  # 16-bit views the fp32 masters are copied into
        self._masters = [s.master for s in with_master]
        # gradients handed over as copies (unscaled by the scaler, or in another dtype), freed after the step
        self._copied_grads = [s for s in self.sharded if scaler is not None or s.grad_copied]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @contextmanager
    def shards_installed(self) -> Generator[None, None, None]:
        """Let the wrapped optimizer see the shards in its groups for the duration."""
        for group, shards in zip(self.optimizer.param_groups, self._shard_groups, strict=True):
            group["params"] = shards
        try:
            yield
        finally:
            for group, params in zip(self.optimizer.param_groups, self._module_groups, strict=True):
                group["params"] = params

    def updated_tensors(self) -> list[torch.Tensor]:
        """What the wrapped optimizer updates, in its state-dict order: the shards (frozen parameters as they are)."""
        with self.shards_installed():
            return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run the closure (forward and backward, reducing gradients), update my shards, gather the parameters.
        With loss scaling, a step in which any rank's gradients overflowed is skipped on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = self._scaler is not None and self._scaler.verdict is StepVerdict.OVERFLOW
        if not skip:
            with self.shards_installed(), self._kernels.applied(self.optimizer), self._on_local_tensors():
                self.optimizer.step()
            for sharded in self._copied_grads:
                sharded.release_grad_copy()
            with torch.no_grad():
                # from host masters: asynchronous, ordered before the gather on the device's stream (a copy within one
                # device is asynchronous anyway)
                if self._masters:
                    torch._foreach_copy_(self._module_rows, self._masters, non_blocking=True)
                if self._gather is not None:
                    self._gather(self._shard_ids)
        if self._scaler is not None:
            self._scaler.update()
        return loss

    def _on_local_tensors(self) -> AbstractContextManager[None]:
        return nullcontext() if self._local is None else self._local.applied(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the module parameters' gradients (the wrapped optimizer's job) and the shards' ones."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for sharded in self.sharded:
            if set_to_none:
                sharded.shard.grad = None
            elif sharded.shard.grad is not None:
                sharded.shard.grad.to_local().zero_()

    def main_params(self) -> Iterator[nn.Parameter]:
        """The parameters whose ``.grad`` holds the reduced gradients, for clipping: the full module parameters
        where the stage keeps full gradients, else the shards (their norms then combine across ranks)."""
        groups = self._module_groups if self._grad_home is GradHome.MODULE else self._shard_groups
        for params in groups:
            yield from params

    def state_dict(self) -> dict[str, Any]:
        with self.shards_installed():
            return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self.shards_installed():
            self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "Parameter groups cannot be added to a ZeRO-sharded optimizer after setup."
            " HINT: return every parameter group from `configure_optimizers`."
        )

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
