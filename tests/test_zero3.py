"""Stage 3 against DDP: the same seeded LightningModules, written for DDP, trained on 2 and 3 CPU processes under
``"zero3"`` (and variants with other wrap policies and activation checkpointing) must end with the same parameters,
buffers, optimizer state, losses and metrics, with the fp32 tolerance (and its rationale) of tests/oracle.py.
Stage 3 keeps each parameter as a ``Shard(0)`` DTensor: the parameters are compared whole, and each rank's shard is
checked to be its rows of the whole. Memory is measured by walking tensors, never from RSS.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zero import Zero2Strategy, Zero3Strategy, ZeroStrategy
from lightning_zero._stage3.lazy import LazyTensor
from lightning_zero._wrap import (
    CheckpointedForward,
    MinParams,
    ModuleClasses,
    RepeatedEntries,
    apply_activation_checkpointing,
    choose_units,
    resolve_policy,
)
from lightning_zero.memory import storage_bytes
from tests.launch import launch
from tests.oracle import FP32, close, compare_optimizer_states
from tests.scenarios import Scenario, StrategySpec, run_scenarios, trainer_features
from tests.workers.modules_zero3 import Block, TiedLM, blocks_only

CHECKPOINTED = {"activation_checkpointing": True}
VARIANTS = [
    StrategySpec("zero3"),
    StrategySpec("zero3", {"auto_wrap_policy": {"torch.nn.Linear"}}, label="zero3_linear_units"),
    StrategySpec("zero3", {"auto_wrap_policy": 1000, "activation_checkpointing": {Block}}, label="zero3_min_params"),
    StrategySpec("zero3", {"auto_wrap_policy": blocks_only}, label="zero3_callable"),
    StrategySpec("zero3", CHECKPOINTED, label="zero3_checkpointed"),
    # shards, gradients and optimizer state in files, re-read for the recomputation
    StrategySpec("zero3_infinity", CHECKPOINTED, label="zero3_infinity_checkpointed"),
]
STAGES_1_2_CHECKPOINTED = [StrategySpec(f"zero{s}", CHECKPOINTED, label=f"zero{s}_checkpointed") for s in (1, 2)]
ZERO2 = StrategySpec("zero2")
MEMORY = {"width": 64, "depth": 6, "probe_memory": True}


def scenario(name: str, module: str = "classifier", strategies: list[Any] | None = None, **fields: Any) -> Scenario:
    return Scenario(name, module=module, strategies=strategies or ["ddp", "zero3"], **fields)


SCENARIOS = [
    # ties, units called twice, frozen and trainable in one unit, penalties read outside forward, evaluation
    scenario(
        "tied_lm",
        "tied_lm",
        ["ddp", *VARIANTS, *STAGES_1_2_CHECKPOINTED],
        limit_val_batches=2,
        trainer_kwargs={"val_check_interval": 3},
        after_fit=("validate", "test", "predict"),
    ),
    # a global norm over the shards of several units, gradients kept per unit across micro-batches (no-sync)
    scenario(
        "tied_lm_clip_accumulate",
        "tied_lm",
        trainer_kwargs={"gradient_clip_val": 0.5, "gradient_clip_algorithm": "norm", "accumulate_grad_batches": 2},
        max_steps=3,
    ),
    # everything in the root unit: a 0-dim parameter (replicated), a parameter with fewer rows than ranks
    *trainer_features("zero3"),
    # checkpoints: saved at step 4, resumed in a fresh Trainer and module, compared with the same under DDP
    scenario("resume", "tied_lm", module_kwargs={"scheduler": True}, resume_at=4, max_steps=6),
    scenario("resume_from_ddp_file", "tied_lm", resume_at=4, max_steps=6, save_with=StrategySpec("ddp")),
    scenario("resume_from_zero2_dir", "tied_lm", ["zero2", "zero3"], resume_at=4, max_steps=6, save_with=ZERO2),
    # layers built in configure_model: created on the meta device, materialised shard by shard
    scenario(
        "configure_model",
        "tied_lm",
        ["ddp", "zero3", "zero3_infinity"],
        module_kwargs={"build_in_configure_model": True},
    ),
    scenario("memory", "tied_lm", module_kwargs=MEMORY, max_steps=2),
]
BY_NAME = {s.name: s for s in SCENARIOS}
PAIRS = [(s.name, strategy.label) for s in SCENARIOS for strategy in s.compared]
MEASURED = ("_bytes", "block_forward_calls")  # callback metrics compared by the memory and checkpointing tests


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}procs")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_scenarios(SCENARIOS, request.param, tmp_path_factory.mktemp("zero3"))


@pytest.mark.slow
def test_each_rank_holds_its_rows(results: list[dict[Any, Any]]) -> None:
    """Every stage-3 parameter is a ``Shard(0)`` DTensor whose part on rank ``r`` is the ``r``-th ``torch.chunk`` of
    the whole (empty on trailing ranks of a short first dimension), as DCP and consolidation read it."""
    ranks = len(results)
    checked = 0
    for run in PAIRS:
        for rank, per_rank in enumerate(results):
            for key, (by_rows, local) in per_rank[run]["shards"].items():
                assert by_rows, f"{run} {key}: not Shard(0)"
                rows = torch.chunk(per_rank[run]["state_dict"][key], ranks)
                want = rows[rank] if rank < len(rows) else per_rank[run]["state_dict"][key][:0]
                assert torch.equal(local, want), f"{run} rank{rank} {key}"
                checked += 1
    assert checked > 0


@pytest.mark.parametrize(("name", "strategy"), PAIRS, ids=[f"{n}-{s}" for n, s in PAIRS])
@pytest.mark.slow
def test_matches_reference(results: list[dict[Any, Any]], name: str, strategy: str) -> None:
    spec = BY_NAME[name]
    reference = spec.reference.label
    for rank, per_rank in enumerate(results):
        expected, actual = per_rank[(name, reference)], per_rank[(name, strategy)]
        what = f"{name}/{strategy}/rank{rank}"
        assert len(actual["losses"]) == len(expected["losses"]) > 0
        close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), f"{what} losses")
        assert actual["state_dict"].keys() == expected["state_dict"].keys()
        for key, value in expected["state_dict"].items():
            close(actual["state_dict"][key], value, f"{what} {key}")
        assert len(actual["optimizers"]) == len(expected["optimizers"])
        for i, (got, want) in enumerate(zip(actual["optimizers"], expected["optimizers"], strict=True)):
            compare_optimizer_states(got, want, f"{what} optimizer{i}")
        assert actual["lrs"] == expected["lrs"]
        metrics = {k: v for k, v in expected["callback_metrics"].items() if not k.endswith(MEASURED)}
        for key, value in metrics.items():
            assert actual["callback_metrics"][key] == FP32.approx(value), f"{what} {key}"
        for fn in spec.after_fit:
            if fn == "predict":
                close(actual["predict"], expected["predict"], f"{what} predict")
            else:  # one dict of logged metrics per dataloader (`approx` does not reach into a list of dicts)
                assert len(actual[fn]) == len(expected[fn])
                for got, want in zip(actual[fn], expected[fn], strict=True):
                    assert got == FP32.approx(want), f"{what} {fn}"


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LIGHTNING_ZERO_SHM_DISABLE") == "1",
    reason="LIGHTNING_ZERO_SHM_DISABLE=1: no shared memory, no ring",
)
def test_units_are_gathered_in_the_shared_ring(results: list[dict[Any, Any]]) -> None:
    """On one host the ranks write their rows of a unit into one shared buffer of the gather ring, which each reads in
    place (no copy into and out of the channel's slots): the ring is sized for the largest unit but the root, so every
    block's gather is one: at least one per block in each forward (the blocks kept for their backward are not gathered
    again)."""
    for rank, per_rank in enumerate(results):
        run = per_rank[("tied_lm_clip_accumulate", "zero3")]
        steps, micro_batches = 3, 2
        units = len(TiedLM().blocks)
        assert run["ring_handouts"] >= steps * micro_batches * units, f"rank{rank}: {run['ring_handouts']}"


@pytest.mark.slow
def test_training_moved_the_weights(results: list[dict[Any, Any]]) -> None:
    """Guards the oracle: the reassembled weights really changed, so matching DDP means something."""
    torch.manual_seed(0)
    initial = TiedLM().state_dict()
    final = results[0][("tied_lm", "zero3")]["state_dict"]["blocks.2.up.weight"]
    assert (final - initial["blocks.2.up.weight"]).abs().max() > 1e-3


def padded_bytes(module: nn.Module, world_size: int, trainable_only: bool = False) -> int:
    """Bytes each rank keeps for ``module``'s parameters under stage 3: ``ceil(rows / N)`` rows of each (its storage is
    padded to that on every rank), 0-dim parameters whole."""
    params = [p for p in module.parameters() if p.requires_grad or not trainable_only]
    return sum(4 * math.ceil(p.shape[0] / world_size) * p[0].numel() if p.dim() else 4 for p in params)


def local_numel(module: nn.Module, world_size: int, rank: int) -> int:
    """Elements of this rank's shards of the trainable parameters, unpadded (``torch.chunk`` rows)."""
    total = 0
    for p in module.parameters():
        if p.requires_grad:
            chunks = torch.chunk(torch.empty(p.shape[0]), world_size)
            total += (chunks[rank].numel() if rank < len(chunks) else 0) * p[0].numel()
    return total


@pytest.mark.slow
def test_bytes_at_rest_are_totals_over_n_plus_padding(results: list[dict[Any, Any]]) -> None:
    world_size = len(results)
    module = TiedLM(**MEMORY)
    num_trainable = sum(p.requires_grad for p in module.parameters())
    ddp = results[0][("memory", "ddp")]["callback_metrics"]
    state_total = 0
    for rank, per_rank in enumerate(results):
        zero3 = per_rank[("memory", "zero3")]["callback_metrics"]
        assert zero3["param_bytes"] == padded_bytes(module, world_size)
        one_row_each = sum(4 * p[0].numel() for p in module.parameters())
        assert zero3["param_bytes"] <= ddp["param_bytes"] / world_size + one_row_each
        # gradient shards are kept as stage 2 keeps them: padded rows, and a presence flag per parameter
        flags = 4 * num_trainable
        assert zero3["grad_bytes"] == padded_bytes(module, world_size, trainable_only=True) + flags
        # AdamW: two moments over this rank's rows, and a 4-byte step counter per parameter on every rank
        assert zero3["state_bytes"] == 2 * 4 * local_numel(module, world_size, rank) + 4 * num_trainable
        state_total += zero3["state_bytes"] - 4 * num_trainable
    assert state_total == ddp["state_bytes"] - 4 * num_trainable  # the moments are an exact partition


def unit_bytes(module: TiedLM) -> list[int]:
    """Full parameter bytes of each unit the default policy makes, the root unit (the rest) included."""
    units = [4 * sum(p.numel() for p in block.parameters()) for block in module.blocks]
    root = 4 * sum(p.numel() for p in module.parameters()) - sum(units)
    return [*units, root]


@pytest.mark.slow
def test_peak_bytes_in_forward_and_backward(results: list[dict[Any, Any]]) -> None:
    """Walked from inside every module's forward hooks and its outputs' gradient hooks (backward): shards, gathered
    units, gradients and optimizer state together stay below what the shards hold at rest plus two whole units, each
    with its parameters and its gradients (the one at work, and the root unit or the next one gathered)."""
    module = TiedLM(**MEMORY)
    largest = sorted(unit_bytes(module))[-2:]
    ddp = results[0][("memory", "ddp")]["callback_metrics"]
    for per_rank in results:
        zero3 = per_rank[("memory", "zero3")]["callback_metrics"]
        at_rest = zero3["param_bytes"] + zero3["grad_bytes"] + zero3["state_bytes"]
        assert at_rest < zero3["step_peak_bytes"] <= at_rest + 2 * sum(largest)
        assert zero3["step_peak_bytes"] < ddp["param_bytes"] + ddp["grad_bytes"] + ddp["state_bytes"]


@pytest.mark.slow
def test_configure_model_never_holds_the_whole_model(results: list[dict[Any, Any]]) -> None:
    """Layers built in configure_model hold no bytes until sharded; building and materialising them allocates at
    most this rank's shards plus one whole parameter at a time (two: gloo's worker thread may let go of the last one's
    broadcast buffer a moment after the broadcast returns); and the weights equal DDP's eager ones (above)."""
    world_size = len(results)
    module = TiedLM()
    largest_module = max(4 * sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    for per_rank in results:
        zero3 = per_rank[("configure_model", "zero3")]["callback_metrics"]
        ddp = per_rank[("configure_model", "ddp")]["callback_metrics"]
        assert zero3["configure_model_bytes"] == 0
        assert ddp["configure_model_bytes"] == 4 * sum(p.numel() for p in module.parameters())
        assert zero3["param_bytes"] == padded_bytes(module, world_size)
        assert zero3["param_bytes"] < zero3["setup_peak_bytes"] <= zero3["param_bytes"] + 2 * largest_module


@pytest.mark.parametrize("strategy", ["zero1_checkpointed", "zero2_checkpointed", "zero3_checkpointed"])
@pytest.mark.slow
def test_activation_checkpointing_recomputes_blocks(results: list[dict[Any, Any]], strategy: str) -> None:
    """Every block ran its forward again in backward, and (above) training matched DDP: each parameter still got
    its gradient once per backward, so the stage 1 and 2 reducers saw each exactly once."""
    for per_rank in results:
        plain = per_rank[("tied_lm", "ddp")]["callback_metrics"]["block_forward_calls"]
        checkpointed = per_rank[("tied_lm", strategy)]["callback_metrics"]["block_forward_calls"]
        assert checkpointed == 2 * plain > 0


# --- failures that must be clear and early, never a hang -----------------------------------------------------------


@pytest.mark.slow
def test_uneven_evaluation_batches_fail_before_the_first_batch(tmp_path: Path) -> None:
    uneven = scenario(
        "uneven_val",
        "tied_lm",
        ["zero3"],
        module_kwargs={"uneven_val": True},
        limit_val_batches=1.0,
        trainer_kwargs={"use_distributed_sampler": False, "val_check_interval": 2},
    )
    counts = r"rank 0: \[6\], rank 1: \[7\]"
    with pytest.raises(RuntimeError, match=rf"(?s)same, known number of validation batches.*{counts}.*HINT"):
        run_scenarios([uneven], 2, tmp_path)


@pytest.mark.slow
def test_unit_parameter_read_outside_forward_is_refused(tmp_path: Path) -> None:
    outside = scenario("penalty_on_unit", "tied_lm", ["zero3"], module_kwargs={"penalty_on_unit": True})
    with pytest.raises(RuntimeError, match=r"(?s)The loss is a DTensor.*gathered only inside that unit's.*HINT"):
        run_scenarios([outside], 2, tmp_path)


@pytest.mark.slow
def test_a_trained_module_is_freed_once_dropped(tmp_path: Path) -> None:
    """Three fits in one process, each with a fresh module, then three Fabric loops, each with a fresh Fabric and
    module: after each, nothing of this package keeps the module (and its shards and optimizer state) alive; the user
    dropping it frees it. Nothing set-up put into the process outlives them, under Fabric too, which never tears its
    strategy down: torch's collectives (which torch 2.8 has the package rebind), the c10d logger's handlers and the
    warnings filters are as before, and the user's own ``fully_shard`` model trains to the same weights as before the
    runs. The stall watchdog's thread, the process's, ends once the process group is destroyed."""
    launch("tests.workers.lifetime", [str(tmp_path)], 2)
    as_before = {"alive": [False, False, False], "changed": [], "same weights": True}
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"trainer": as_before, "fabric": as_before, "watchdog thread after the group": "ended"}, rank


# --- options, policies, one device: in this process ----------------------------------------------------------------


def test_zero3_is_registered() -> None:
    assert StrategyRegistry["zero3"]["strategy"] is Zero3Strategy
    assert ZeroStrategy(stage=3).stage == 3
    trainer = pl.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, Zero3Strategy)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("auto_wrap_policy", "no_such_package.Block", r"` names 'no_such_package.Block', which cannot be imported"),
        ("auto_wrap_policy", {"torch.optim.Adam"}, r"` holds .*Adam.*, which is not a subclass of `torch.nn.Module`"),
        ("auto_wrap_policy", 0, r"=0` must be a positive parameter count"),
        ("auto_wrap_policy", True, r"=True` is not a policy"),
        ("auto_wrap_policy", 2.5, r"=2.5` is not a policy"),
        ("activation_checkpointing", [], r"=\[\]` is not a policy"),
        ("activation_checkpointing", "Block", r"` names 'Block', which cannot be imported"),
    ],
)
def test_bad_policies_are_named(option: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^`{option}{message}.*HINT: pass `{option}` as"):
        Zero3Strategy(**{option: value})


def test_wrap_policy_is_for_stage_3_only() -> None:
    with pytest.raises(ValueError, match=r"`auto_wrap_policy` shapes the units of stage 3.*HINT"):
        Zero2Strategy(auto_wrap_policy={nn.Linear})
    with pytest.raises(ValueError, match=r"Zero3Strategy runs stage 3.*HINT"):
        Zero3Strategy(stage=2)


def unit_names(module: nn.Module, policy: Any) -> list[str]:
    names = {id(m): n for n, m in module.named_modules()}
    return [names[id(m)] for m in choose_units(module, resolve_policy("auto_wrap_policy", policy))]


def test_wrap_policies_pick_units_deepest_first() -> None:
    module = TiedLM()
    blocks = ["blocks.2", "blocks.1", "blocks.0"]
    assert unit_names(module, None) == blocks
    assert unit_names(module, {Block}) == unit_names(module, ["tests.workers.modules_zero3.Block"]) == blocks
    assert unit_names(module, lambda m, name: isinstance(m, Block) and name != "blocks.1") == ["blocks.2", "blocks.0"]
    # every Linear but the head, whose weight is tied to the embedding's: a tie stays inside one unit
    linears = unit_names(module, {nn.Linear})
    assert "head" not in linears and "mixer" in linears and len(linears) == 1 + 3 * 3
    # by size: `up` and `down` (1200 and 1176 parameters) alone; what is left of a block (648) stays in the root
    assert unit_names(module, 1000) == [f"blocks.{i}.{part}" for i in (2, 1, 0) for part in ("down", "up")]
    by_600 = [f"blocks.{i}.{part}" for i in (2, 1, 0) for part in ("skip", "down", "up")]
    assert unit_names(module, 600) == [*by_600, "mixer"]  # a frozen `skip` too; the tied embedding never
    assert unit_names(module, {nn.ModuleList}) == []  # never called: cannot gather around a forward
    assert resolve_policy("x", 5) == MinParams(5) and resolve_policy("x", nn.Linear) == ModuleClasses((nn.Linear,))
    assert resolve_policy("x", None) == RepeatedEntries()


def test_activation_checkpointing_keeps_names_and_is_idempotent() -> None:
    module = TiedLM()
    keys = list(module.state_dict())
    assert apply_activation_checkpointing(module, RepeatedEntries()) == ["blocks.0", "blocks.1", "blocks.2"]
    first = module.blocks[0].forward
    assert isinstance(first, CheckpointedForward)
    assert apply_activation_checkpointing(module, ModuleClasses((Block, nn.Linear))) == [
        "mixer", "blocks.0", "blocks.1", "blocks.2", "head",
    ]  # fmt: skip
    assert module.blocks[0].forward is first and list(module.state_dict()) == keys


def test_one_device_trains_plainly() -> None:
    """On one device stage 3 shards nothing: no meta tensors, no DTensors, the user's optimizer as it is."""
    pl.seed_everything(0)
    module = TiedLM(build_in_configure_model=True)
    strategy = Zero3Strategy(activation_checkpointing=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module)
    assert module.memory["configure_model_bytes"] == 4 * sum(p.numel() for p in module.parameters())
    assert not any(isinstance(p, DTensor) or p.is_meta for p in module.parameters())
    assert isinstance(module.blocks[0].forward, CheckpointedForward)
    assert trainer.callback_metrics["block_forward_calls"] == 2 * 2 * (len(module.blocks) + 1)


def test_policies_from_a_lightning_cli_config(tmp_path: Path) -> None:
    """YAML names classes by import path: a LightningCLI config can set both options."""
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  logger: false\n"
        "  strategy:\n"
        "    class_path: lightning_zero.Zero3Strategy\n"
        "    init_args:\n"
        "      auto_wrap_policy: [tests.workers.modules_zero3.Block]\n"
        "      activation_checkpointing: true\n"
    )
    cli = LightningCLI(TiedLM, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, Zero3Strategy)
    assert strategy.config.auto_wrap_policy == ModuleClasses((Block,))
    assert strategy.config.activation_checkpointing == ModuleClasses((Block,))


def test_init_context_records_parameters_and_keeps_buffers() -> None:
    """Parameters built in the context hold no memory and record what gives them values (eager construction's
    values, bit for bit); buffers keep theirs; a tie stays a tie; the plan gives each lazy parameter one meta one."""

    class Custom(nn.Module):  # values computed before registration, and a buffer
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(3) * 0.5)
            self.register_buffer("table", torch.arange(4.0))

    def build() -> nn.Sequential:
        linear, custom, norm = nn.Linear(3, 3), Custom(), nn.BatchNorm1d(3)
        head = nn.Linear(3, 3, bias=False)
        head.weight = linear.weight
        model = nn.Sequential(linear, custom, norm, head)
        nn.init.trunc_normal_(norm.weight, std=0.02)  # after construction, as `model.apply(init_fn)` does
        return model

    torch.manual_seed(3)
    eager = build()
    after_eager = torch.rand(2)
    strategy = Zero3Strategy(parallel_devices=[torch.device("cpu")] * 2)
    torch.manual_seed(3)
    with strategy.tensor_init_context():
        model = build()
    assert torch.equal(torch.rand(2), after_eager)  # the generator moved on as in eager construction
    assert all(isinstance(p, LazyTensor) and not p.is_meta for p in model.parameters())
    assert storage_bytes(model.parameters()) == 0 and model[3].weight is model[0].weight
    assert torch.equal(model[1].table, torch.arange(4.0)) and type(model[2].running_var) is torch.Tensor
    for (name, expected), actual in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(actual.real_view(), expected), name
    with strategy.tensor_init_context(empty_init=False):
        assert type(nn.Linear(2, 2).weight) is nn.Parameter
    with Zero3Strategy(parallel_devices=[torch.device("cpu")]).tensor_init_context():
        assert type(nn.Linear(2, 2).weight) is nn.Parameter  # one device: nothing to shard
    assert type(nn.Linear(2, 2).weight) is nn.Parameter

    plan = strategy.mode.meta_init.plan(model)
    assert all(p.is_meta and type(p) is nn.Parameter for p in model.parameters()) and model[3].weight is model[0].weight
    assert [name for name, _ in plan.by_name(model)] == ["0.weight", "0.bias", "1.scale", "2.weight", "2.bias"]
    assert plan.resets == []


def test_own_meta_parameters_get_their_module_reset() -> None:
    """A parameter the user puts on the meta device stays meta, as in eager construction: its module's
    ``reset_parameters()`` gives it values after sharding; with no such module, it is refused."""
    strategy = Zero3Strategy(parallel_devices=[torch.device("cpu")] * 2)
    with strategy.model_sharded_context():
        linear = nn.Linear(3, 3, device="meta")
    assert linear.weight.is_meta
    plan = strategy.mode.meta_init.plan(nn.Sequential(linear))
    assert [(type(r.module).__name__, r.owned) for r in plan.resets] == [("Linear", ["weight", "bias"])]
    holder = nn.Module()
    holder.weight = linear.weight  # held only by a module without `reset_parameters()`
    with pytest.raises(ValueError, match=r"\['weight'\] are on the meta device.*HINT: create them without"):
        strategy.mode.meta_init.plan(holder)
