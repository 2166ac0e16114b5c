"""DeepSpeed ZeRO checkpoints (made by DeepSpeed itself, see tests/fixtures/deepspeed/make_fixtures.py) read without
DeepSpeed: every parameter's fp32 master, Adam moments and step equal the engine's before it saved, bit for bit, in
every layout; they resume under every stage at another world size as ``"ddp"`` resumes from the same state; and what
cannot be read is refused by name."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

import lightning_zero  # noqa: F401
from lightning_zero import consolidate_checkpoint
from lightning_zero.__main__ import main as command_line
from lightning_zero._checkpoint.deepspeed import read_deepspeed_checkpoint
from lightning_zero._checkpoint.deepspeed_files import is_deepspeed_checkpoint
from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero._checkpoint.unpickling import DEEPSPEED_STAND_INS, Unpickling, load_torch_file
from tests.fixtures.deepspeed.make_fixtures import CASES, HERE, checkpoint_path
from tests.fixtures.deepspeed.model import FixtureModel
from tests.launch import launch
from tests.oracle import close, full
from tests.workers.deepspeed_resume import RESUMES, VALIDATED

WORKER = "tests.workers.deepspeed_resume"


def truth(case: str) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(HERE / f"{case}.truth.pt")


def model_for(case: str) -> FixtureModel:
    return FixtureModel(**CASES[case].model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reads_what_the_engine_held(case: str) -> None:
    expected = truth(case)
    read = read_deepspeed_checkpoint(checkpoint_path(case), Unpickling.RESTRICTED)
    for name, value in {**expected["params"], **expected["buffers"]}.items():
        assert read.state_dict[name].dtype == value.dtype, name
        assert torch.equal(read.state_dict[name], value), name
    assert read.optimizer["state"].keys() == expected["exp_avg"].keys()  # trained parameters only, each once
    for key in ("exp_avg", "exp_avg_sq", "step"):
        for name, value in expected[key].items():
            assert torch.equal(read.optimizer["state"][name][key], value), (name, key)
    model = model_for(case)
    assert read.state_dict.keys() == model.state_dict().keys()
    if model.hparams.tied:
        assert read.state_dict["head.weight"] is read.state_dict["embed.weight"]
    assert read.frozen == (["hidden.bias"] if model.hparams.frozen else [])
    assert len(read.optimizer["param_groups"]) == model.hparams.groups


def test_lightning_state_comes_with_it() -> None:
    read = read_deepspeed_checkpoint(checkpoint_path("lightning_stage2_w2"), Unpickling.RESTRICTED)
    assert read.rest["global_step"] == 3
    assert {"epoch", "loops", "callbacks", "lr_schedulers", "hyper_parameters"} <= read.rest.keys()
    assert read.rest["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 3
    assert read.rest["lr_schedulers"][0]["last_epoch"] == 3
    assert read.optimizer["param_groups"][1]["lr"] == read.rest["lr_schedulers"][0]["_last_lr"][1]


@pytest.mark.parametrize("where", ["save directory", "tag directory", "lightning"])
def test_consolidates_to_a_file_any_module_loads(where: str, tmp_path: Path) -> None:
    case = "lightning_stage3_w3" if where == "lightning" else "groups_stage2_w3"
    path = checkpoint_path(case)
    if where == "tag directory":
        path = path / (path / "latest").read_text()
    out = tmp_path / "out.ckpt"
    assert command_line(["consolidate", str(path), str(out)]) == 0
    checkpoint = torch.load(out)
    expected = truth(case)
    model = model_for(case)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer = torch.optim.AdamW(model.param_groups())
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    named = dict(model.named_parameters())
    for name in expected["exp_avg"]:
        assert torch.equal(optimizer.state[named[name]]["exp_avg_sq"], expected["exp_avg_sq"][name]), name
        assert torch.equal(named[name].detach(), expected["params"][name]), name
    weights = torch.load(consolidate_checkpoint(path, tmp_path / "weights.ckpt", weights_only=True))
    assert "optimizer_states" not in weights and "lr_schedulers" not in weights
    assert all(torch.equal(weights["state_dict"][n], v) for n, v in checkpoint["state_dict"].items())


def test_frozen_parameters_may_be_in_the_optimizer_or_not() -> None:
    case = "frozen_stage2_w2"
    read = read_deepspeed_checkpoint(checkpoint_path(case), Unpickling.RESTRICTED)
    model = model_for(case)
    with_frozen = torch.optim.AdamW(model.parameters())  # DeepSpeed left hidden.bias out; torch keeps it, stateless
    checkpoint = read.checkpoint_for(model, [with_frozen])
    with_frozen.load_state_dict(checkpoint["optimizer_states"][0])
    named = dict(model.named_parameters())
    assert not with_frozen.state[named["hidden.bias"]]
    assert torch.equal(with_frozen.state[named["out.weight"]]["exp_avg"], truth(case)["exp_avg"]["out.weight"])


def test_fabric_loads_it_in_place() -> None:
    case = "subgroups_stage3_w2"
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero3")
    fabric.launch()  # one process: this one
    model = model_for(case)
    module, optimizer = fabric.setup(model, torch.optim.AdamW(model.param_groups()))
    rest = fabric.load(checkpoint_path(case), {"model": module, "optimizer": optimizer})
    expected = truth(case)
    named = dict(model.named_parameters())
    for name, value in expected["params"].items():
        assert torch.equal(full(named[name]).detach(), value), name
    for name, value in expected["exp_avg"].items():
        assert torch.equal(full(optimizer.state[named[name]]["exp_avg"]), value), name
    assert rest["lr_schedulers"] == []


# --- refused, by name ------------------------------------------------------------------------------------------------


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "stage3_w2"
    shutil.copytree(HERE / "stage3_w2", target)
    return target


def tag_of(path: Path) -> Path:
    return path / (path / "latest").read_text()


def test_a_missing_rank_file_is_named(copy: Path) -> None:
    (tag_of(copy) / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks .*missing: \[1\].*HINT"):
        read_deepspeed_checkpoint(copy, Unpickling.RESTRICTED)


@pytest.mark.parametrize(("name", "kind"), [("zero_pp_rank_0_mp_rank_01_optim_states.pt", "tensor"),
                                            ("layer_01-model_states.pt", "pipeline")])  # fmt: skip
def test_model_parallel_checkpoints_are_refused(copy: Path, name: str, kind: str) -> None:
    shutil.copy(tag_of(copy) / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag_of(copy) / name)
    with pytest.raises(CheckpointError, match=f"{kind} parallelism.*HINT"):
        read_deepspeed_checkpoint(copy, Unpickling.RESTRICTED)


def test_a_missing_tag_is_named(copy: Path) -> None:
    (copy / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match=r"names the tag 'global_step9'.*HINT"):
        read_deepspeed_checkpoint(copy, Unpickling.RESTRICTED)


def test_another_model_is_refused_by_name() -> None:
    read = read_deepspeed_checkpoint(checkpoint_path("stage2_w2"), Unpickling.RESTRICTED)
    other = FixtureModel()
    other.out = torch.nn.Linear(61, 36)
    other.extra = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"`out.weight` \(37, 61\) here, \(36, 61\).*`extra.weight` only in"):
        read.checkpoint_for(other, [])
    grouped = FixtureModel(groups=2)
    with pytest.raises(CheckpointError, match=r"holds 1 optimizer param groups; 2 are configured.*HINT"):
        read.checkpoint_for(grouped, [torch.optim.AdamW(grouped.param_groups())])
    tied = FixtureModel(tied=True)
    with pytest.raises(CheckpointError, match=r"only in the checkpoint: \['head.weight'\]"):
        read.checkpoint_for(tied, [torch.optim.AdamW(tied.parameters())], strict=False)


def test_other_classes_in_the_pickles_need_trust(copy: Path, tmp_path: Path) -> None:
    file = tag_of(copy) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    states = torch.load(file)  # a model-state file names no DeepSpeed class
    torch.save({**states, "hyper_parameters": argparse.Namespace(width=3)}, file)
    with pytest.raises(CheckpointError, match=r"`argparse.Namespace`.*could run code.*HINT"):
        consolidate_checkpoint(copy, tmp_path / "out.ckpt")
    out = torch.load(consolidate_checkpoint(copy, tmp_path / "out.ckpt", trust_pickle=True), weights_only=False)
    assert out["hyper_parameters"].width == 3  # DeepSpeed's own classes loaded as their stand-ins all the while


def test_only_deepspeed_directories_are_taken_for_one(tmp_path: Path) -> None:
    assert is_deepspeed_checkpoint(HERE / "stage1_w2") and is_deepspeed_checkpoint(tag_of(HERE / "stage1_w2"))
    assert not is_deepspeed_checkpoint(tmp_path) and not is_deepspeed_checkpoint(HERE / "stage1_w2.truth.pt")


# --- resumed by the strategies ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed_resume")
    for _, _, case in RESUMES:  # what "ddp" resumes from: the same state as one ordinary file
        consolidate_checkpoint(checkpoint_path(case), out / f"{case}.ckpt")
    launch(WORKER, [str(out)], world_size=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("label", "strategy", "case"), RESUMES)
def test_resumes_exactly_and_trains_on_as_ddp(resumed: Path, label: str, strategy: str, case: str) -> None:
    restored: dict[str, Any] = torch.load(resumed / f"{label}-restored.pt")
    expected = truth(case)
    for name, value in expected["params"].items():
        assert torch.equal(restored["params"][name], value), name
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert restored[key].keys() == expected[key].keys()
        for name, value in expected[key].items():
            assert torch.equal(restored[key][name], value), (name, key)
    if CASES[case].lightning:  # Lightning's loop and scheduler state came with it
        scheduler = read_deepspeed_checkpoint(checkpoint_path(case), Unpickling.RESTRICTED).rest["lr_schedulers"][0]
        assert restored["global_step"] == 3 and restored["lr"] == scheduler["_last_lr"]
    else:
        assert restored["global_step"] == 0
    ddp = torch.load(resumed / f"ddp-{label}-final.pt")
    final = torch.load(resumed / f"{label}-final.pt")
    assert final["global_step"] == ddp["global_step"] == restored["global_step"] + 3
    for name, value in ddp["params"].items():
        close(final["params"][name], value, f"{label} {name} after 3 more steps")


@pytest.mark.slow
def test_validate_loads_the_weights(resumed: Path) -> None:
    validated = torch.load(resumed / "validated.pt")
    for name, value in truth(VALIDATED)["params"].items():
        assert torch.equal(validated[name], value), name


def test_optimizer_state_that_cannot_be_mapped_is_named(tmp_path: Path) -> None:
    copy = tmp_path / "stage2_w2"
    shutil.copytree(HERE / "stage2_w2", copy)
    file = tag_of(copy) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim = load_torch_file(file.read_bytes(), "", Unpickling.TRUSTED, DEEPSPEED_STAND_INS)
    state = optim["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["exp_avg"] = state["exp_avg"][:-1]  # one element short: no longer one value per element of the partition
    torch.save(optim, file)
    with pytest.raises(CheckpointError, match=rf"{file.name}.*`exp_avg` is neither one value per element.*HINT"):
        consolidate_checkpoint(copy, tmp_path / "out.ckpt", trust_pickle=True)
