"""``_offload/local_step.py``: an elementwise optimizer stepping on its DTensor shards' local tensors gives the numbers
it gives on plain tensors, step after step, while the plan it keeps between steps is overtaken by what users and
checkpoints do to the optimizer: a state entry replaced, a state dict loaded, a parameter without a gradient."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero._offload.local_step import LocalStep

pytestmark = pytest.mark.usefixtures("one_rank")

Change = Callable[[torch.optim.Optimizer, int], None]


def _pair() -> tuple[list[torch.Tensor], list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    mesh = init_device_mesh("cpu", (1,))
    shards = [
        torch.nn.Parameter(DTensor.from_local(p.detach().clone(), mesh, [Shard(0)], run_check=False)) for p in plain
    ]
    return plain, shards


def _train(params: list[torch.Tensor], local: bool, change: Change, steps: int = 6) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)
    stepper = LocalStep()
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        for index, param in enumerate(params):
            grad = torch.randn(param.shape, generator=generator)
            if index == 1 and step == 3:
                param.grad = None  # no gradient this step: AdamW leaves it alone
            elif isinstance(param, DTensor):
                param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
            else:
                param.grad = grad
        change(optimizer, step)
        if local:
            with stepper.applied(optimizer):
                optimizer.step()
        else:
            optimizer.step()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


def _nothing(optimizer: torch.optim.Optimizer, step: int) -> None:
    pass


def _reset_moments(optimizer: torch.optim.Optimizer, step: int) -> None:
    """A user's callback replacing state entries between steps (a new tensor, not an in-place write)."""
    if step == 4:
        for state in optimizer.state.values():
            state["exp_avg"] = torch.zeros_like(state["exp_avg"])


class _Reload:
    """A state dict saved at step 2 loaded at step 4: the state is replaced whole."""

    def __init__(self) -> None:
        self.saved: dict | None = None

    def __call__(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if step == 2:
            copy = torch.utils._pytree.tree_map
            self.saved = copy(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, optimizer.state_dict())
        if step == 4:
            optimizer.load_state_dict(self.saved)


@pytest.mark.parametrize("change", [_nothing, _reset_moments, _Reload], ids=["steady", "entry_replaced", "reloaded"])
def test_steps_on_local_tensors_as_on_plain_ones(change: Callable[[], Change] | Change) -> None:
    plain, shards = _pair()
    make = change if isinstance(change, type) else lambda: change
    expected = _train(plain, local=False, change=make())
    got = _train(shards, local=True, change=make())
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
