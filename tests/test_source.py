"""``_checkpoint/source.py`` on its own: each kind of checkpoint a load is given (a directory of this package, a
DeepSpeed checkpoint, an ordinary file) opened by :func:`open_checkpoint` and asked the same questions, and what it
cannot answer refused by name. No processes: the directory is written by the package's writer in a one-rank gloo
group, the DeepSpeed checkpoints are DeepSpeed's own (tests/fixtures/deepspeed)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero._checkpoint import publish
from lightning_zero._checkpoint.error import CheckpointError, NoCheckpoint, StateNotSaved
from lightning_zero._checkpoint.live import named_optimizer_state, save_directory
from lightning_zero._checkpoint.source import Live, open_checkpoint
from lightning_zero._checkpoint.unpickling import Unpickling
from lightning_zero._checkpoint.whole import write_file
from tests.fixtures.deepspeed.make_fixtures import HERE, checkpoint_path
from tests.fixtures.deepspeed.model import FixtureModel


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)  # a buffer beside the parameters
        self.b = nn.Linear(4, 2)


def _stepped() -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = _Net()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    for param in module.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    return module, optimizer


@pytest.fixture
def saved(one_rank: None, tmp_path: Path) -> tuple[Path, _Net, torch.optim.Optimizer]:
    """A checkpoint directory of a stepped module and its Adam, with Lightning's entries beside them."""
    module, optimizer = _stepped()
    checkpoint = {
        "state_dict": module.state_dict(),
        "optimizer_states": [named_optimizer_state(optimizer, module)],
        "epoch": 3,
        "lr_schedulers": [{"last_epoch": 3}],
    }
    path = tmp_path / "checkpoint"
    save_directory(checkpoint, module, path)
    return path, module, optimizer


class _Recorder:
    """A live in-place loader that records what the source hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def load_directory(self, opened: Any, optimizers_for: Any, strict: bool = True) -> dict[str, Any]:
        self.calls.append((opened, optimizers_for, strict))
        return {"loaded": "in place"}


def _live(modules: dict[str, nn.Module], optimizers: list[torch.optim.Optimizer], strict: bool = True) -> Live:
    return Live(
        modules=modules,
        optimizers_for=lambda _: optimizers,
        in_place=_Recorder(),
        take_whole=lambda whole: {"taken": whole},
        strict=strict,
    )


# --- a directory of this package -------------------------------------------------------------------------------------


def test_a_directory_reads_whole_as_ddp_would_have_saved_it(saved: tuple[Path, _Net, torch.optim.Optimizer]) -> None:
    path, module, optimizer = saved
    whole = open_checkpoint(path, unpickling=Unpickling.RESTRICTED).whole()
    assert whole["epoch"] == 3 and whole["lr_schedulers"] == [{"last_epoch": 3}]
    assert whole["state_dict"].keys() == module.state_dict().keys()
    for name, value in module.state_dict().items():
        assert torch.equal(whole["state_dict"][name], value), name
    expected = optimizer.state_dict()
    assert whole["optimizer_states"][0]["param_groups"] == expected["param_groups"]
    for index, entries in expected["state"].items():
        for key, value in entries.items():
            assert torch.equal(whole["optimizer_states"][0]["state"][index][key], value), (index, key)
    weights = open_checkpoint(path, unpickling=Unpickling.RESTRICTED).whole(optimizer_states=False)
    assert "optimizer_states" not in weights and "lr_schedulers" not in weights and weights["epoch"] == 3


def test_a_directory_restores_in_place_once_opened(saved: tuple[Path, _Net, torch.optim.Optimizer]) -> None:
    path, module, optimizer = saved
    live = _live({"model": module}, [optimizer], strict=False)
    assert open_checkpoint(path).restore(live) == {"loaded": "in place"}
    [(opened, optimizers_for, strict)] = live.in_place.calls  # type: ignore[attr-defined]
    assert opened.path == path and opened.meta["checkpoint"]["epoch"] == 3
    assert optimizers_for({}) == [optimizer] and strict is False


def test_a_directory_is_no_raw_state_dict(saved: tuple[Path, _Net, torch.optim.Optimizer]) -> None:
    with pytest.raises(CheckpointError, match=r"is a checkpoint directory, and `fabric.load_raw`.*HINT"):
        open_checkpoint(saved[0]).raw()


def test_a_damaged_shard_stops_the_read_with_its_name(saved: tuple[Path, _Net, torch.optim.Optimizer]) -> None:
    path = saved[0]
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    source = open_checkpoint(path)  # the layout holds: the shard files' sums are checked as they are read
    with pytest.raises(CheckpointError, match=rf"{shard.name} is damaged: its CRC-32.*HINT"):
        source.whole()


def test_a_directory_missing_its_metadata_is_refused_when_opened(
    saved: tuple[Path, _Net, torch.optim.Optimizer],
) -> None:
    (saved[0] / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"not a complete lightning_zero checkpoint: it lacks `.metadata`"):
        open_checkpoint(saved[0])


def test_the_kept_copy_of_an_interrupted_publish_is_read(saved: tuple[Path, _Net, torch.optim.Optimizer]) -> None:
    path, module, _ = saved
    path.rename(publish.kept_copy(path))
    with pytest.warns(UserWarning, match=r"stopped between two renames"):
        source = open_checkpoint(path)
    assert torch.equal(source.whole()["state_dict"]["a.weight"], module.a.weight)


def test_nothing_at_the_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(NoCheckpoint, match=r"nowhere does not exist.*HINT") as raised:
        open_checkpoint(tmp_path / "nowhere")
    assert isinstance(raised.value, FileNotFoundError)  # as Lightning's own loader raises for a missing file


# --- a DeepSpeed checkpoint ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["save directory", "tag directory"])
def test_a_deepspeed_checkpoint_reads_whole_from_its_save_or_tag_directory(where: str) -> None:
    """Against what DeepSpeed's engine held before it saved (the fixture's truth, read from the live engine): every
    parameter and buffer, and each parameter's Adam moments and step, found by name once the whole checkpoint's
    optimizer state is loaded into an optimizer built on the module's parameter groups, as ``"ddp"`` would."""
    case = "groups_stage2_w3"
    path = checkpoint_path(case)
    if where == "tag directory":
        path = path / (path / "latest").read_text()
    whole = open_checkpoint(path, unpickling=Unpickling.RESTRICTED).whole()
    truth = torch.load(HERE / f"{case}.truth.pt")
    model = FixtureModel(groups=2)
    assert whole["state_dict"].keys() == model.state_dict().keys()
    for name, value in {**truth["params"], **truth["buffers"]}.items():
        assert torch.equal(whole["state_dict"][name], value), name
    model.load_state_dict(whole["state_dict"])
    optimizer = torch.optim.AdamW(model.param_groups())
    optimizer.load_state_dict(whole["optimizer_states"][0])
    named = dict(model.named_parameters())
    assert {name for name, p in named.items() if optimizer.state[p]} == truth["exp_avg"].keys()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        for name, value in truth[key].items():
            assert torch.equal(optimizer.state[named[name]][key], value), (name, key)
    weights = open_checkpoint(path, unpickling=Unpickling.RESTRICTED).whole(optimizer_states=False)
    assert "optimizer_states" not in weights and "lr_schedulers" not in weights


def test_a_deepspeed_checkpoint_restores_one_module_through_take_whole() -> None:
    case = "stage2_w2"
    model = FixtureModel()
    optimizer = torch.optim.AdamW(model.parameters())
    source = open_checkpoint(checkpoint_path(case), unpickling=Unpickling.RESTRICTED)
    taken = source.restore(_live({"model": model}, [optimizer]))["taken"]
    optimizer.load_state_dict(taken["optimizer_states"][0])
    truth = torch.load(HERE / f"{case}.truth.pt")
    named = dict(model.named_parameters())
    for name, value in truth["exp_avg"].items():
        assert torch.equal(optimizer.state[named[name]]["exp_avg"], value), name
    assert torch.equal(taken["state_dict"]["out.weight"], truth["params"]["out.weight"])
    with pytest.raises(CheckpointError, match=r"of one engine's module, and the load names.*\['g', 'd'\].*HINT"):
        source.restore(_live({"g": model, "d": FixtureModel()}, []))
    with pytest.raises(CheckpointError, match=r"is a checkpoint directory, and `fabric.load_raw`"):
        source.raw()


def test_a_deepspeed_checkpoint_without_optimizer_files_is_refused_by_name(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(HERE / "stage3_w2", tmp_path / "stage3_w2"))
    tag = copy / (copy / "latest").read_text()
    for file in tag.glob("*optim_states.pt"):
        file.unlink()
    with pytest.raises(StateNotSaved, match=r"has no optimizer file.*HINT"):
        open_checkpoint(copy)


# --- an ordinary file ------------------------------------------------------------------------------------------------


@pytest.fixture
def file(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    module, optimizer = _stepped()
    contents = {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 2,
                "lr_schedulers": []}  # fmt: skip
    path = tmp_path / "last.ckpt"
    write_file(path, contents)
    return path, contents


def test_a_file_is_read_by_the_readers_reader_once_checked(file: tuple[Path, dict[str, Any]]) -> None:
    path, contents = file
    reads: list[Path] = []

    def read_file(at: Path) -> Any:
        reads.append(at)
        return torch.load(at, weights_only=True)

    source = open_checkpoint(path, read_file=read_file)
    taken = source.restore(_live({"model": _Net()}, []))["taken"]
    assert torch.equal(taken["state_dict"]["a.weight"], contents["state_dict"]["a.weight"]) and taken["epoch"] == 2
    weights = source.whole(optimizer_states=False)
    assert "optimizer_states" not in weights and weights["epoch"] == 2
    assert torch.equal(source.raw()["optimizer_states"][0]["state"][0]["exp_avg"],
                       contents["optimizer_states"][0]["state"][0]["exp_avg"])  # fmt: skip
    assert reads == [path, path, path]


def test_a_damaged_file_is_named_before_it_is_read(file: tuple[Path, dict[str, Any]]) -> None:
    path, contents = file
    data = bytearray(path.read_bytes())
    stored = contents["state_dict"]["a.weight"].numpy().tobytes()
    at = bytes(data).index(stored)  # the tensor's bytes, whose record's CRC-32 the zip holds
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last.ckpt is damaged.*HINT"):
        open_checkpoint(path, read_file=lambda _: pytest.fail("read before its check")).whole()
