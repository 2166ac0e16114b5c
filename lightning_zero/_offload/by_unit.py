"""Stepping the optimizer one stage-3 unit at a time (``offload_parameters="disk"``), so that a rank holds one unit's
shards, gradients and optimizer state at a time, and what that needs of the optimizer."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero._offload.param_files import ParameterFiles

# Optimizers whose update of each parameter reads only that parameter's gradient and state, so that stepping on one
# unit's parameters at a time updates each as one step on all would: torch's own, but L-BFGS (a closure over all).
_PER_PARAMETER = ("torch.optim.",)
_WHOLE = ("LBFGS",)


def check_per_parameter(optimizer: Optimizer) -> None:
    """Refuse an optimizer that stepping one unit at a time could change (see :data:`_PER_PARAMETER`), and step hooks
    (they would run once per unit)."""
    kind = type(optimizer)
    if not kind.__module__.startswith(_PER_PARAMETER) or kind.__name__ in _WHOLE:
        raise ValueError(
            f"`offload_parameters='disk'` steps the optimizer on one unit's parameters at a time, which equals one"
            f" step on all only for an optimizer that updates each parameter from its own gradient and state;"
            f" `{kind.__module__}.{kind.__name__}` is not known to. HINT: use a `torch.optim` optimizer (not LBFGS),"
            " or keep the parameters in host memory with `offload_parameters=True`."
        )
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)
    if any(hooks):
        raise ValueError(
            f"{kind.__name__} has step hooks, and `offload_parameters='disk'` steps it once per unit, which would run"
            " them once per unit. HINT: remove the hooks (`handle.remove()`), or use `offload_parameters=True`."
        )


@contextmanager
def one_unit_at_a_time(
    optimizer: Optimizer, files: ParameterFiles, after_chunk: Callable[[list[torch.Tensor]], None]
) -> Generator[None, None, None]:
    """While in the context, ``optimizer.step`` runs the closure on all parameters (a precision plugin's gradient
    clipping sees them all), then steps on one unit's parameters at a time (:meth:`ParameterFiles.chunks`), calling
    ``after_chunk`` with each chunk after its step, so that the process holds one unit's shards, gradients and state
    at a time."""
    check_per_parameter(optimizer)
    previous = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, say
    step = optimizer.step

    def chunked(closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in optimizer.param_groups]
        group_of = {id(p): index for index, params in enumerate(groups) for p in params}
        try:
            for chunk in files.chunks(list(itertools.chain.from_iterable(groups))):
                narrowed: list[list[torch.Tensor]] = [[] for _ in groups]
                for param in chunk:
                    narrowed[group_of[id(param)]].append(param)
                for group, params in zip(optimizer.param_groups, narrowed, strict=True):
                    group["params"] = params
                step()
                after_chunk(chunk)
        finally:
            for group, params in zip(optimizer.param_groups, groups, strict=True):
                group["params"] = params
        return loss

    optimizer.step = chunked  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del optimizer.step
        else:
            optimizer.step = previous  # type: ignore[method-assign]
