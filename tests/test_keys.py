"""``_checkpoint/keys.py`` on its own: the flat key syntax, the sharded-entry rule and the naming of optimizer state,
on a real optimizer's state dict. No processes."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero._checkpoint import keys


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two names


def _stepped_adam(module: nn.Module) -> torch.optim.Optimizer:
    groups = [{"params": list(module.blocks.parameters()), "lr": 0.1}, {"params": [module.embed.weight], "lr": 0.2}]
    optimizer = torch.optim.Adam(groups)
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def test_keys_round_trip_names_with_dots_and_slashes() -> None:
    """A parameter name may hold dots and slashes; entry names never hold a slash, so the last one splits."""
    names = ["blocks.0.weight", "odd/name.with/slash", "x"]
    flat = [keys.state_key(3, fqn, "exp_avg") for fqn in names] + [keys.model_key(n) for n in names]
    flat.append(keys.state_key(4, "x", "step"))  # another optimizer's entry is not optimizer 3's
    assert [(fqn, entry) for _, fqn, entry in keys.optimizer_entries(flat, 3)] == [(n, "exp_avg") for n in names]
    assert list(keys.model_entries(flat)) == names


def test_named_state_inverts_to_the_optimizer_state_dict() -> None:
    """Naming a real Adam state dict by parameter and indexing it back gives the same dict, tensors untouched; a tied
    parameter goes by its first name."""
    module = _Tied()
    optimizer = _stepped_adam(module)
    names_by_id = keys.module_names(module)
    assert names_by_id[id(module.head.weight)] == "embed.weight"
    names = [names_by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]
    original = optimizer.state_dict()
    named = keys.named_optimizer_state(original, names)
    assert set(named["state"]) == set(names) and named["param_groups"][1]["params"] == ["embed.weight"]
    indexed, index = keys.indexed_optimizer_state(named)
    assert index == {name: i for i, name in enumerate(names)}
    assert indexed["param_groups"] == original["param_groups"]
    assert indexed["state"].keys() == original["state"].keys()
    for i, entries in original["state"].items():
        for entry, value in entries.items():
            assert indexed["state"][i][entry] is value


def test_flatten_records_the_entries_sharded_like_their_parameter() -> None:
    """``exp_avg`` and ``exp_avg_sq`` are shaped like their parameter and sharded with it; ``step`` never is, even
    where it happens to have the parameter's shape (a 1-element parameter)."""
    module = nn.Linear(1, 1)  # bias: shape (1,), like a 1-element step tensor would be
    optimizer = torch.optim.Adam(module.parameters())
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    names = ["weight", "bias"]
    named = keys.named_optimizer_state(optimizer.state_dict(), names)
    named["state"]["bias"]["step"] = torch.ones(1)
    shapes = {n: p.shape for n, p in module.named_parameters()}
    flat, meta = keys.flatten({"weight": module.weight}, [named], shapes)
    assert meta["sharded"] == {0: {"weight": ["exp_avg", "exp_avg_sq"], "bias": ["exp_avg", "exp_avg_sq"]}}
    assert flat[keys.state_key(0, "bias", "step")] is named["state"]["bias"]["step"]
    assert flat[keys.model_key("weight")] is module.weight
    assert meta["param_groups"][0] == named["param_groups"]


def test_a_record_wins_over_the_shape_rule() -> None:
    shape = torch.Size((3,))
    like = torch.zeros(3)
    assert keys.sharded_with_parameter(None, 0, "exp_avg", like, shape)
    assert not keys.sharded_with_parameter(None, 0, "step", like, shape)
    assert not keys.sharded_with_parameter(None, 0, "exp_avg", torch.zeros(2), shape)
    assert not keys.sharded_with_parameter({0: ["momentum"]}, 0, "exp_avg", like, shape)
    assert keys.sharded_with_parameter({0: ["momentum"]}, 0, "momentum", torch.zeros(2), shape)


def test_a_file_records_the_sharded_entries_only_where_the_rule_would_not_tell() -> None:
    """Adam's moments are shaped like their parameter: the rule tells, so a single file holds no record (its optimizer
    states are ``"ddp"``'s). An entry sharded in another shape (a factored second moment), or a parameter whose shape
    a save filter left out of the file, needs the record, by parameter index."""
    shapes = {"w": torch.Size((4, 2)), "b": torch.Size((4,))}
    groups = [{"params": ["w", "b"], "lr": 0.1}]
    whole = {
        "state": {"w": {"exp_avg": torch.zeros(4, 2), "step": torch.tensor(3.0)}, "b": {"exp_avg": torch.zeros(4)}}
    }
    whole["param_groups"] = groups
    adam = {"w": ["exp_avg"], "b": ["exp_avg"]}
    assert keys.file_record(adam, whole, shapes) is None
    whole["state"]["w"]["row_var"] = torch.zeros(4)
    assert keys.file_record({**adam, "w": ["exp_avg", "row_var"]}, whole, shapes) == {
        0: ["exp_avg", "row_var"],
        1: ["exp_avg"],
    }
    del whole["state"]["w"]["row_var"]
    assert keys.file_record(adam, whole, {"b": shapes["b"]}) == {0: ["exp_avg"], 1: ["exp_avg"]}
