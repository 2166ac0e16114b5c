"""The gradient policies of ``_engine/reducers.py`` on their own, in one process on a gloo group of one rank: where
each stage leaves the reduced gradients, what an unused parameter keeps, and what a no-sync backward does. The
reference is autograd's own gradient of the same loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero._engine.engine import ZeroEngine
from lightning_zero._engine.reducers import AllReduceReducer, GradHome, ReduceMode, ReduceScatterReducer
from lightning_zero._transport.mesh import data_parallel_mesh

BUCKET_BYTES = 64  # a few parameters per bucket, so that several buckets launch during backward


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.unused = nn.Linear(2, 2)  # never in the loss: its gradient stays None, as under DDP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().sum()


def _reference_grads(batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = _Net()
    for batch in batches:
        net(batch).backward()
    return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


def _engine(reducer: type) -> tuple[_Net, ZeroEngine]:
    torch.manual_seed(0)
    net = _Net()
    return net, ZeroEngine(net, reducer, data_parallel_mesh("cpu", 1), BUCKET_BYTES)


def _shard_grads(net: _Net, engine: ZeroEngine) -> dict[str, torch.Tensor | None]:
    by_param = {id(s.param): s for s in engine.sharded}
    grads = {}
    for name, param in net.named_parameters():
        grad = by_param[id(param)].shard.grad
        grads[name] = None if grad is None else grad.to_local()
    return grads


@pytest.mark.usefixtures("one_rank")
def test_stage1_keeps_full_gradients_in_the_module() -> None:
    batches = [torch.randn(5, 3)]
    net, engine = _engine(AllReduceReducer)
    assert len(engine.reducer.buckets) > 1 and engine.reducer.grad_home is GradHome.MODULE
    net(batches[0]).backward()
    expected = _reference_grads(batches)
    for name, param in net.named_parameters():
        if name.startswith("unused"):
            assert param.grad is None and _shard_grads(net, engine)[name] is None
        else:
            torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0)
    for name, grad in _shard_grads(net, engine).items():  # the shard's gradient is a view of the module's
        if grad is not None:
            assert grad.data_ptr() == dict(net.named_parameters())[name].grad.data_ptr()


@pytest.mark.usefixtures("one_rank")
def test_stage2_keeps_only_gradient_shards() -> None:
    batches = [torch.randn(5, 3)]
    net, engine = _engine(ReduceScatterReducer)
    assert engine.reducer.grad_home is GradHome.SHARD
    net(batches[0]).backward()
    expected = _reference_grads(batches)
    shards = _shard_grads(net, engine)
    for name, param in net.named_parameters():
        assert param.grad is None  # freed once staged
        if name.startswith("unused"):
            assert shards[name] is None
        else:
            torch.testing.assert_close(shards[name], expected[name], rtol=0, atol=0)


@pytest.mark.parametrize("reducer", [AllReduceReducer, ReduceScatterReducer])
@pytest.mark.usefixtures("one_rank")
def test_an_accumulation_window_sums_its_backward_passes(reducer: type) -> None:
    """Stage 1 accumulates full gradients locally through the no-sync passes and reduces at the last; stage 2 keeps
    reducing every pass into its shards. Either way the window's gradient is the sum of its passes'."""
    batches = [torch.randn(5, 3) for _ in range(3)]
    net, engine = _engine(reducer)
    engine.reducer.mode = ReduceMode.LOCAL
    for batch in batches[:-1]:
        net(batch).backward()
    engine.reducer.mode = ReduceMode.SYNC
    net(batches[-1]).backward()
    expected = _reference_grads(batches)
    shards = _shard_grads(net, engine)
    for name in expected:
        torch.testing.assert_close(shards[name], expected[name], rtol=0, atol=0)  # same sums, same order
