"""The seam over ``fully_shard`` (``lightning_zero/_stage3/seam.py``), item by item, on the torch installed, in one
process: on torch's fake process group of 4 ranks as rank 3 (the rank ``fully_shard`` gives the fewest rows; its
collectives complete at once without moving data), where sharding splits rows and a unit really gathers, and on a gloo
group of one rank where a test needs the values a gather brings. CI runs these fast tests on every torch it installs
(the floor, the current release and the ceiling), so a release whose internals differ fails here, naming the item, and
at set-up (:func:`check_contract`), never at step 100. Each contract break changes torch, never the checker."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_zero._stage3 import seam

FAKE_RANKS, FAKE_RANK = 4, 3


@pytest.fixture
def fake_ranks() -> Iterator[None]:
    """This process as rank 3 of a fake group of 4."""
    dist.init_process_group("fake", store=FakeStore(), rank=FAKE_RANK, world_size=FAKE_RANKS)
    yield
    dist.destroy_process_group()


class Net(nn.Module):
    """Two units (``a``, ``b``) inside the root, which manages ``head`` itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def sharded() -> tuple[Net, list[FSDPModule]]:
    net = Net()
    fully_shard(net.a)
    fully_shard(net.b)
    fully_shard(net)
    units = [net.a, net.b, net]
    assert all(isinstance(u, FSDPModule) for u in units)
    return net, units  # type: ignore[return-value]


def step(net: Net) -> torch.Tensor:
    loss = net(torch.randn(2, 6, generator=torch.Generator().manual_seed(1))).square().sum()
    loss.backward()
    return loss.detach()


@pytest.mark.usefixtures("fake_ranks")
def test_the_contract_holds_on_the_installed_torch() -> None:
    _, units = sharded()
    seam.check_contract(units)


@pytest.mark.usefixtures("one_rank")
def test_unit_state_tells_whether_the_root_ran_a_forward() -> None:
    net, _ = sharded()
    assert not seam.has_run_forward(net)  # type: ignore[arg-type]
    step(net)
    assert seam.has_run_forward(net)  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_rank")
def test_parameter_groups_hold_a_shard_of_each_parameter_a_unit_manages() -> None:
    net, _ = sharded()
    for unit, names in ((net.a, {"weight", "bias"}), (net, {"head.weight", "head.bias"})):
        shards = seam.unit_shards(unit)  # type: ignore[arg-type]
        owned = {
            f"{'head.' if owner is net.head else ''}{name}" for owner, name in (seam.shard_owner(s) for s in shards)
        }
        assert owned == names
        assert all(seam.registered(s) for s in shards)
        assert all(isinstance(seam.sharded_param(s), DTensor) for s in shards)


@pytest.mark.usefixtures("one_rank")
def test_shard_storage_moved_elsewhere_is_what_the_unit_gathers() -> None:
    net, units = sharded()
    reference = net(torch.ones(1, 6)).detach()
    net.reshard()  # type: ignore[operator]  # the root stays gathered after a forward
    for unit in units:
        seam.settle_shards(unit)
        for shard in seam.unit_shards(unit):
            moved = seam.padded_shard(shard).clone()
            seam.move_shard(shard, moved)
            assert seam.padded_shard(shard) is moved
            assert seam.sharded_param(shard).to_local().data_ptr() == moved.data_ptr()
            assert seam.registered(shard)  # the parameter object stays: the optimizer holds it
            moved.zero_()
    assert reference.abs().sum() > 0
    assert torch.equal(net(torch.ones(1, 6)).detach(), torch.zeros(1, 3))  # the forward gathered the zeroed storage


@pytest.mark.usefixtures("one_rank")
def test_a_gradient_shard_is_a_dtensor_laid_out_as_its_parameter() -> None:
    net, _ = sharded()
    for shard in seam.unit_shards(net.a):  # type: ignore[arg-type]
        param = seam.sharded_param(shard)
        grad = seam.shard_grad(shard, torch.ones_like(param.to_local()))
        assert isinstance(grad, DTensor) and grad.shape == param.shape and grad.placements == param.placements


@pytest.mark.parametrize("rows", [10, 5, 4, 2])
def test_the_row_split_is_fully_shards(rows: int) -> None:
    """On every rank of the fake group in turn, ``my_rows`` of a full parameter is exactly the local shard
    ``fully_shard`` made of it (uneven splits, and ranks holding no row, included)."""
    seen = []
    for rank in range(FAKE_RANKS):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=FAKE_RANKS)
        try:
            torch.manual_seed(0)
            layer = nn.Linear(3, rows)
            full = layer.weight.detach().clone()
            fully_shard(layer)
            mine = seam.my_rows(full, rank, FAKE_RANKS)
            assert torch.equal(mine, layer.weight.to_local()), (rank, mine.shape, layer.weight.to_local().shape)
            seen.append(mine)
        finally:
            dist.destroy_process_group()
    assert torch.equal(torch.cat(seen), full)  # every row once, in rank order


def counting_arounds(calls: dict[str, int]) -> tuple[seam.Around, seam.Around]:
    def around(which: str) -> seam.Around:
        def run(collective: Callable[[], Any]) -> Any:
            calls[which] += 1
            return collective()

        return run

    return around("gather"), around("reduce")


def own_collectives() -> tuple[Any, Any]:
    return _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce


@pytest.mark.usefixtures("fake_ranks")
def test_arounds_of_a_units_own_collectives_and_their_removal() -> None:
    originals = own_collectives()
    net, _ = sharded()
    calls = {"gather": 0, "reduce": 0}
    seam.around_own_collectives(net.a, *counting_arounds(calls))  # type: ignore[arg-type]
    assert seam.own_collective_arounds(net.a) is not None  # type: ignore[arg-type]
    step(net)
    # unit `a` only: gathered for its forward and again for its backward (resharded after forward), reduced once
    assert calls == {"gather": 2, "reduce": 1}
    seam.forget_own_collectives(net.a)  # type: ignore[arg-type]
    assert own_collectives() == originals  # nothing left rebound
    step(net)
    assert calls == {"gather": 2, "reduce": 1}


@pytest.mark.usefixtures("fake_ranks")
def test_arounds_end_with_the_last_unit_that_has_them() -> None:
    """A module dropped without a teardown (Fabric has none): once its units are freed, ``fully_shard``'s names are
    torch's again."""
    originals = own_collectives()
    net = sharded()[0]
    seam.around_own_collectives(net.a, *counting_arounds({"gather": 0, "reduce": 0}))  # type: ignore[arg-type]
    seam.around_own_collectives(net.b, *counting_arounds({"gather": 0, "reduce": 0}))  # type: ignore[arg-type]
    assert own_collectives() != originals
    del net
    gc.collect()
    assert own_collectives() == originals


@pytest.mark.usefixtures("one_rank")
def test_reset_leaves_every_unit_sharded_after_an_aborted_step() -> None:
    net, _ = sharded()
    net(torch.ones(1, 6))  # the root stays gathered after forward: as a step that raised before backward leaves it
    seam.reset_after_failure(net)  # type: ignore[arg-type]
    assert all(isinstance(p, DTensor) for p in net.parameters())
    step(net)  # trains again


@pytest.mark.usefixtures("one_rank")
def test_stream_keepalives_are_released_from_the_units_shared_context() -> None:
    """One rank keeps nothing for a stream (it gathers nothing), so what several ranks keep is put there by hand: the
    release empties the context every unit shares, whichever unit it is called on."""
    net, _ = sharded()
    step(net)  # the root's lazy set-up: every unit shares its context now
    context = net._get_fsdp_state()._comm_ctx
    assert net.a._get_fsdp_state()._comm_ctx is context
    context.all_gather_state = object()
    kept = getattr(context, "reduce_scatter_states", None)
    if kept is not None:
        kept.append(object())
    else:
        context.reduce_scatter_state = object()
    seam.release_stream_keepalives(net.a)  # type: ignore[arg-type]
    assert context.all_gather_state is None
    assert (kept == []) if kept is not None else context.reduce_scatter_state is None
    step(net)  # trains on


@pytest.mark.usefixtures("one_rank")
def test_dtensor_layout_given_to_a_new_local_tensor() -> None:
    net, _ = sharded()
    param = net.a.weight
    assert isinstance(param, DTensor)
    local = torch.full_like(param.to_local(), 2.0)
    moved = seam.dtensor_like(param, local)
    assert moved.to_local().data_ptr() == local.data_ptr()
    assert moved.placements == param.placements and moved.shape == param.shape


# --- a torch without each item: every break below changes torch (as a release that lacks the item would), sharding
# happening after it where the item is how `fully_shard` shards


def _break_unit_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FSDPModule, "_get_fsdp_state", lambda self: object())


def _break_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit state keeps its parameter groups under another name."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    original = FSDPState.__getattribute__

    def renamed(state: Any, name: str) -> Any:
        if name in ("_fsdp_param_groups", "_fsdp_param_group"):
            raise AttributeError(name)
        return original(state, name)

    monkeypatch.setattr(FSDPState, "__getattribute__", renamed)


def _break_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_fsdp_param.FSDPParam, "reset_sharded_param")


def _break_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fully_shard`` splits rows as ``torch.tensor_split`` does (5 rows on 4 ranks: 2, 1, 1, 1, where ``torch.chunk``
    gives 2, 2, 1, 0)."""
    monkeypatch.setattr(_fsdp_param, "_chunk_with_empty", lambda tensor, chunks, dim: list(
        torch.tensor_split(tensor, chunks, dim=dim)))  # fmt: skip


def _break_own_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    if seam.CUSTOM_COLLECTIVES:
        monkeypatch.delattr(FSDPModule, "set_custom_all_gather")
    else:
        monkeypatch.delattr(_fsdp_param_group, "foreach_all_gather")


def _break_keepalives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The units' shared context keeps no buffers for streams."""
    monkeypatch.setattr(_fsdp_param_group.FSDPCommContext, "lazy_init", lambda self, device: None)


def _break_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(FSDPModule, "set_reshard_after_forward")


def _break_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DTensor is no longer built from a local tensor and a layout."""

    def refuse(*args: Any, **kwargs: Any) -> DTensor:
        raise TypeError("DTensor.__new__() takes other arguments")

    monkeypatch.setattr(DTensor, "__new__", staticmethod(refuse))


def _break_secondary(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fully_shard`` no longer makes a unit's post-forward groups through the function the seam replaces."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as module

    monkeypatch.delattr(module, "_get_post_forward_mesh_info")


BREAKS = {
    "unit state": _break_unit_state,
    "parameter groups": _break_groups,
    "shard storage": _break_storage,
    "row split": _break_rows,
    "own collectives": _break_own_collectives,
    "stream keepalives": _break_keepalives,
    "reset": _break_reset,
    "DTensor layout": _break_layout,
    "secondary copy": _break_secondary,
}


def test_every_contract_item_has_a_break_below() -> None:
    assert [item.name for item in seam.CONTRACT] == list(BREAKS)


@pytest.mark.usefixtures("fake_ranks")
@pytest.mark.parametrize("item", list(BREAKS))
def test_a_torch_without_an_item_is_refused_at_set_up_naming_it(monkeypatch: pytest.MonkeyPatch, item: str) -> None:
    if item == "row split":  # how `fully_shard` shards: broken before it
        BREAKS[item](monkeypatch)
        _, units = sharded()
    else:
        _, units = sharded()
        BREAKS[item](monkeypatch)
    with pytest.raises(seam.TorchContractError, match=rf"contract item '{item}' .*HINT: use a torch release"):
        seam.check_contract(units)
