"""Stage 3's construction context on its own, in one process: whatever the user's code does to parameters while they
are built (and after, until set-up), the values they are given later are eager construction's, bit for bit, and the
random generator moves on exactly as in eager construction (so later draws, dropout's, are the same).

Each case builds a model twice from the same seed, eagerly and under :class:`MetaInit`, and compares every parameter
with ``torch.equal`` and the next draws of the generator. Multi-process parity with ``"ddp"`` is in
tests/test_hf_models.py and tests/test_zero3.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zero._stage3.lazy import Empty, LazyTensor, Source
from lightning_zero._stage3.meta_init import MetaInit


def values(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.real_view() if isinstance(tensor, LazyTensor) else tensor


def hf_style(model: nn.Module) -> nn.Module:
    """Hugging Face's ``_init_weights``: through ``.data``, a padding row zeroed after."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.weight.data[module.padding_idx].zero_()
    return model


def litgpt_style(model: nn.Module) -> nn.Module:
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=math.sqrt(2.0 / 5 / 8))
        elif isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=0.02)

    return model.apply(init)


def by_hand() -> nn.Module:
    model = nn.Linear(6, 8)
    with torch.no_grad():
        model.weight[:, :2] = 1.5  # a slice
        model.weight.data[0] = torch.arange(6.0)  # a row, through `.data`
        model.bias.data = torch.ones(8)  # `.data` set to a real tensor
        model.weight.mul_(2).add_(model.weight.t().contiguous().t())  # reading itself
    return model


def loaded(assign: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = nn.Linear(4, 8)
        model.load_state_dict({"weight": torch.randn(8, 4), "bias": torch.randn(8)}, assign=assign)
        return model

    return build


def ema_copy() -> nn.Module:
    online = nn.Linear(4, 8)
    target = copy.deepcopy(online)  # a copy keeps the values of the moment
    nn.init.zeros_(online.weight)
    return nn.Sequential(online, target)


def derived() -> nn.Module:
    model = nn.Linear(4, 8)
    model.scale = nn.Parameter(model.weight.detach().norm(dim=1) * 2)  # a parameter computed from another
    model.register_buffer("snapshot", model.weight.detach().clone())  # and a buffer
    return model


CASES: dict[str, Callable[[], nn.Module]] = {
    "torch layers": lambda: nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Embedding(11, 7), nn.Conv2d(3, 4, 3)),
    "recurrent and attention": lambda: nn.Sequential(nn.LSTM(4, 8, 2), nn.GRU(4, 4), nn.MultiheadAttention(8, 2)),
    "Hugging Face style": lambda: hf_style(nn.Sequential(nn.Embedding(10, 8, padding_idx=1), nn.Linear(8, 8))),
    "LitGPT style": lambda: litgpt_style(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))),
    "trunc_normal_ rejecting": lambda: nn.init.trunc_normal_(nn.Linear(40, 40).weight, std=1.0, a=-0.3, b=0.3),
    "orthogonal_ (wide, conv)": lambda: nn.init.orthogonal_(nn.Conv2d(3, 4, 3).weight, gain=2.0),
    "xavier, kaiming, sparse": lambda: nn.ParameterList(
        [
            nn.init.xavier_normal_(nn.Parameter(torch.empty(6, 9))),
            nn.init.kaiming_normal_(nn.Parameter(torch.empty(9, 6)), mode="fan_out"),
            nn.init.sparse_(nn.Parameter(torch.empty(6, 9)), sparsity=0.5),
        ]
    ),
    "explicit generator": lambda: nn.init.normal_(nn.Linear(4, 4).weight, generator=torch.Generator().manual_seed(9)),
    "by hand": by_hand,
    "load_state_dict": loaded(assign=False),
    "load_state_dict(assign=True)": loaded(assign=True),
    "deepcopy": ema_copy,
    "derived": derived,
    "weight_norm": lambda: nn.utils.parametrizations.weight_norm(nn.Linear(4, 8)),
    "to bf16": lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)).to(torch.bfloat16),
    "half, frozen": lambda: nn.Linear(4, 8).requires_grad_(False).half(),
}


def as_module(built: nn.Module | torch.Tensor) -> nn.Module:
    if isinstance(built, nn.Module):
        return built
    holder = nn.Module()
    holder.weight = built if isinstance(built, nn.Parameter) else nn.Parameter(built)
    return holder


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_generator_are_eager_constructions(case: str) -> None:
    build = CASES[case]
    torch.manual_seed(0)
    eager = as_module(build())
    next_draws = torch.rand(4)
    torch.manual_seed(0)
    with MetaInit()():
        lazy = as_module(build())
    assert torch.equal(torch.rand(4), next_draws), "the generator did not move on as in eager construction"
    expected = dict(eager.named_parameters()) | dict(eager.named_buffers())
    actual = dict(lazy.named_parameters()) | dict(lazy.named_buffers())
    assert actual.keys() == expected.keys()
    assert all(isinstance(p, LazyTensor) for p in lazy.parameters())
    for name, value in expected.items():
        got = values(actual[name])
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert torch.equal(got, value), name
        assert actual[name].requires_grad == value.requires_grad, name


def test_parameters_hold_no_memory_once_written_whole() -> None:
    """A parameter born from ``torch.empty`` holds nothing; an initialiser that writes it whole lets go of what came
    before; values computed before registration are kept, as the only way to have them."""
    with MetaInit()():
        linear = nn.Linear(4, 8)  # `torch.empty`, then `kaiming_uniform_` and `uniform_`: each writes it whole
        computed = nn.Parameter(torch.randn(3) * 0.5)
        holder = nn.Module()
        holder.scale = computed
    for param in linear.parameters():
        assert isinstance(param._record.steps[0], Empty) and len(param._record.steps) == 2
    assert isinstance(holder.scale._record.steps[0], Source)


def test_a_parameter_left_uninitialised_is_known() -> None:
    """Under ``empty_init`` (Lightning skips ``torch.nn.init`` then) a parameter gets no values: nothing to replay."""
    with MetaInit()():
        weight = nn.Linear(4, 8).weight
        untouched = nn.Module()
        untouched.weight = nn.Parameter(torch.empty(3, 3))
    assert weight._record.initialised and not untouched.weight._record.initialised


def test_values_read_during_construction_are_eager_ones() -> None:
    torch.manual_seed(0)
    eager = nn.Linear(4, 8)
    torch.manual_seed(0)
    with MetaInit()():
        lazy = nn.Linear(4, 8)
        assert lazy.weight.sum().item() == eager.weight.sum().item()
        assert torch.equal(lazy.weight, eager.weight)
        assert repr(lazy.weight).startswith("LazyTensor(shape=(8, 4)")


def test_hugging_face_from_config_and_from_pretrained(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=31, n_positions=16)
    torch.manual_seed(1)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    for build in (lambda: GPT2LMHeadModel(config), lambda: GPT2LMHeadModel.from_pretrained(tmp_path)):
        torch.manual_seed(0)
        eager = build()
        torch.manual_seed(0)
        with MetaInit()():
            lazy = build()
        assert lazy.lm_head.weight is lazy.transformer.wte.weight  # the tie
        for (name, expected), actual in zip(eager.named_parameters(), lazy.parameters(), strict=True):
            assert torch.equal(values(actual), expected), name


def test_attributes_computed_from_parameters_get_their_values() -> None:
    """A plain attribute computed from a parameter while building keeps eager construction's values at set-up; a view
    of a parameter kept as an attribute, which its shards could not follow, is refused with a HINT."""
    torch.manual_seed(0)
    eager = nn.Linear(4, 8)
    torch.manual_seed(0)
    init = MetaInit()
    with init():
        model = nn.Linear(4, 8)
        model.doubled = model.weight.detach() * 2
    init.plan(model)
    assert type(model.doubled) is torch.Tensor and torch.equal(model.doubled, eager.weight.detach() * 2)
    with init():
        model = nn.Linear(4, 8)
        model.transposed = model.weight.detach().t()
    with pytest.raises(RuntimeError, match=r"`Linear.transposed` is a view of a parameter.*HINT: compute it"):
        init.plan(model)


def test_resizing_a_parameter_while_building_is_refused() -> None:
    with MetaInit()():
        model = nn.Linear(4, 8)
        with pytest.raises(RuntimeError, match=r"`resize_` on a parameter.*HINT: create the parameter"):
            model.weight.data.resize_(2, 2)


def test_parameters_nothing_initialised_get_their_modules_reset() -> None:
    """Under ``empty_init=True`` Lightning skips ``torch.nn.init``: such parameters would hold uninitialised memory
    under eager construction, so their module's ``reset_parameters()`` gives them values (as ``FSDPStrategy`` does);
    one whose module has none is left as it is, not refused; one given values after is left to its record."""
    from lightning.fabric.utilities.init import _EmptyInit

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, 3))

    init = MetaInit()
    with _EmptyInit(enabled=True), init():
        model = nn.Sequential(nn.Linear(4, 8), NoReset(), nn.Linear(8, 2))
    nn.init.constant_(model[2].weight, 0.5)  # after the `with` block, as LitGPT's `model.apply(init_fn)`
    plan = init.plan(model)
    resets = [(type(r.module).__name__, r.owned) for r in plan.resets]
    assert resets == [("Linear", ["weight", "bias"]), ("Linear", ["bias"])]
    assert [name for name, lazy in plan.by_name(model) if lazy._record.initialised] == ["2.weight"]
