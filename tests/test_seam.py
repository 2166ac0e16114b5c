"""The seam over ``fully_shard`` (``lightning_zero/_transport/torch_private.py``), item by item, on the torch installed:
in one process, on a gloo group of one rank. CI runs these fast tests on every torch it installs (the floor, the
current release and the ceiling), so a release whose internals differ fails here, naming the item, and at set-up
(:func:`check_contract`), never at step 100."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lightning_zero._transport import torch_private as seam


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


@pytest.mark.usefixtures("one_rank")
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


@pytest.mark.parametrize(
    ("rows", "world_size", "expected"), [(10, 4, [3, 3, 3, 1]), (2, 4, [1, 1, 0, 0]), (8, 2, [4, 4])]
)
def test_the_row_split_is_fully_shards(rows: int, world_size: int, expected: list[int]) -> None:
    full = torch.arange(rows * 3).view(rows, 3)
    pieces = [seam.my_rows(full, rank, world_size) for rank in range(world_size)]
    assert [p.size(0) for p in pieces] == expected
    assert torch.equal(torch.cat(pieces), full)  # each rank's rows in rank order, nothing repeated or lost


@pytest.mark.usefixtures("one_rank")
def test_callbacks_before_a_units_own_collectives_and_their_removal() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    originals = (param_group.foreach_all_gather, param_group.foreach_reduce)
    net, _ = sharded()
    calls = {"gather": 0, "reduce": 0}

    def count(which: str) -> None:
        calls[which] += 1

    seam.before_own_collectives(net.a, lambda: count("gather"), lambda: count("reduce"))  # type: ignore[arg-type]
    assert seam.own_collective_callbacks(net.a) is not None  # type: ignore[arg-type]
    step(net)
    # unit `a` only, reduced once; gathered twice (for forward, and again for backward after resharding), where a
    # group of one rank gathers at all (torch 2.8 does; 2.13 uses the shard as it is)
    assert calls["reduce"] == 1 and calls["gather"] in (0, 2), calls
    before = dict(calls)
    seam.forget_own_collectives(net.a)  # type: ignore[arg-type]
    assert (param_group.foreach_all_gather, param_group.foreach_reduce) == originals  # nothing left rebound
    step(net)
    assert calls == before


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


def _break_unit_state(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.setattr(type(units[0]), "_get_fsdp_state", lambda self: object())


def _break_groups(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.setattr(seam, "_param_groups", lambda unit: [])


def _break_storage(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.delattr(seam.unit_shards(units[0])[0], "_sharded_param_data")


def _break_rows(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.setattr(seam, "my_rows", lambda full, rank, world_size: full[:0])


def _break_own_collectives(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.setattr(seam, "CUSTOM_COLLECTIVES", False)
    monkeypatch.setattr(seam, "_OWN_COLLECTIVES", ("foreach_all_gather_renamed",))


def _break_keepalives(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    context = type(units[0]._get_fsdp_state()._comm_ctx)
    monkeypatch.setattr(context, "lazy_init", lambda self, device: None)  # keeps no buffers for streams


def _break_reset(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.delattr(FSDPModule, "set_reshard_after_forward")


def _break_layout(monkeypatch: pytest.MonkeyPatch, units: list[FSDPModule]) -> None:
    monkeypatch.setattr(seam, "_has", lambda obj, *names: "_spec" not in names and all(hasattr(obj, n) for n in names))


BREAKS = {
    "unit state": _break_unit_state,
    "parameter groups": _break_groups,
    "shard storage": _break_storage,
    "row split": _break_rows,
    "own collectives": _break_own_collectives,
    "stream keepalives": _break_keepalives,
    "reset": _break_reset,
    "DTensor layout": _break_layout,
}


def test_every_contract_item_has_a_break_below() -> None:
    assert [item.name for item in seam.CONTRACT] == list(BREAKS)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("item", list(BREAKS))
def test_a_torch_without_an_item_is_refused_at_set_up_naming_it(monkeypatch: pytest.MonkeyPatch, item: str) -> None:
    _, units = sharded()
    BREAKS[item](monkeypatch, units)
    with pytest.raises(seam.TorchContractError, match=rf"contract item '{item}' .*HINT: use a torch release"):
        seam.check_contract(units)
