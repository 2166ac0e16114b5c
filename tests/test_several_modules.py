"""Several modules per strategy in a Fabric loop, against Fabric's ``"ddp"`` on 2 and 3 processes: a GAN-style loop
(generator and critic, each with its own optimizer, and a frozen feature module set up between them) trains as under
``"ddp"``, saves all of its state in one checkpoint, and resumes from it, or from ``"ddp"``'s file, exactly.

Training is compared with ``"ddp"`` within the fp32 parity tolerance of tests/oracle.py; what a checkpoint restores
is compared exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_zero.fabric import Zero2Strategy
from tests.launch import launch
from tests.oracle import FP32, close
from tests.scenarios import read_results, write_payload

pytestmark = pytest.mark.slow  # every test here launches processes

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "zero2_full"]
SHARDED = STRATEGIES[1:]


# 3 ranks: every parameter's rows split unevenly (2 ranks split them evenly, as the parity tests run)
@pytest.fixture(scope="module", params=[3], ids=lambda n: f"{n}ranks")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp(f"several{request.param}")
    write_payload(out, strategies=STRATEGIES)
    launch("tests.workers.several_modules", [str(out)], request.param)
    return out, read_results(out, request.param)


def compare_snapshots(actual: dict[str, Any], expected: dict[str, Any], what: str, exact: bool = False) -> None:
    assert actual["weights"].keys() == expected["weights"].keys()
    for key, value in expected["weights"].items():
        if exact:
            assert torch.equal(actual["weights"][key], value), f"{what} {key}"
        else:
            close(actual["weights"][key], value, f"{what} {key}", FP32)
    for name, state in expected["optimizers"].items():
        assert actual["optimizers"][name].keys() == state.keys(), f"{what} {name}"
        for index, entries in state.items():
            for key, value in entries.items():
                got = actual["optimizers"][name][index][key]
                if exact:
                    assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), f"{what} {name}[{index}][{key}]"
                else:
                    close(torch.as_tensor(got), torch.as_tensor(value), f"{what} {name}[{index}][{key}]", FP32)


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_gan_loop_trains_as_under_ddp(run: tuple[Path, list[dict]], strategy: str) -> None:
    """Each module reduces its own gradients, the generator's loss reaching the critic's too, and each optimizer steps
    its own module: losses, weights and both optimizers' state follow ``"ddp"``'s."""
    for rank, per_rank in enumerate(run[1]):
        ours, ddp = per_rank[strategy], per_rank["ddp"]
        what = f"rank {rank} {strategy}"
        close(torch.tensor(ours["losses"] + ours["continued"]), torch.tensor(ddp["losses"] + ddp["continued"]), what)
        compare_snapshots(ours["saved"], ddp["saved"], f"{what} at the save")
        compare_snapshots(ours["end"], ddp["end"], f"{what} at the end")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_of_several_modules_resumes_exactly(run: tuple[Path, list[dict]], strategy: str) -> None:
    """Fresh modules of other weights load every module's and optimizer's state as saved, bit for bit, and the user's
    entries; the run then continues as the uninterrupted one did."""
    for rank, per_rank in enumerate(run[1]):
        ours = per_rank[strategy]
        resumed = ours["resumed_from_own"]
        what = f"rank {rank} {strategy}"
        compare_snapshots(resumed["loaded"], ours["saved"], f"{what} loaded", exact=True)
        assert resumed["step"] == 3 and resumed["rest"] == {}
        close(torch.tensor(resumed["losses"]), torch.tensor(ours["continued"]), f"{what} resumed losses")
        compare_snapshots(resumed["end"], ours["end"], f"{what} resumed")


@pytest.mark.parametrize("strategy", SHARDED)
def test_ddps_file_of_several_modules_resumes_under_every_stage(run: tuple[Path, list[dict]], strategy: str) -> None:
    for rank, per_rank in enumerate(run[1]):
        resumed, ddp = per_rank[strategy]["resumed_from_ddp"], per_rank["ddp"]
        what = f"rank {rank} {strategy} from ddp's file"
        compare_snapshots(resumed["loaded"], ddp["saved"], what, exact=True)
        close(torch.tensor(resumed["losses"]), torch.tensor(ddp["continued"]), f"{what} losses")
        compare_snapshots(resumed["end"], ddp["end"], what)


@pytest.mark.parametrize("strategy", SHARDED)
def test_load_without_state_returns_each_module_under_its_name(run: tuple[Path, list[dict]], strategy: str) -> None:
    """``fabric.load(path)`` of a checkpoint of several modules gives what ``"ddp"``'s file holds: each module's state
    dict and each optimizer's state under the names of ``state``."""
    for rank, per_rank in enumerate(run[1]):
        contents, saved = per_rank[strategy]["contents"], per_rank[strategy]["saved"]
        assert contents["keys"] == ["critic", "d_opt", "g_opt", "generator", "step"]
        for module, prefix in (("generator", "g"), ("critic", "d")):
            for name, value in contents["modules"][module].items():
                assert torch.equal(value, saved["weights"][f"{prefix}/{name}"]), f"rank {rank} {module}.{name}"
        assert contents["steps"] == {"g_opt": [3.0] * 4, "d_opt": [3.0] * 4}


def test_a_full_checkpoint_of_several_modules_is_the_file_ddp_writes(run: tuple[Path, list[dict]]) -> None:
    """Under ``state_dict_type="full"`` the file holds the user's names, as ``"ddp"``'s does, and the same tensors."""
    files = run[0] / "files"
    ours, ddp = torch.load(files / "zero2_full.ckpt"), torch.load(files / "ddp.ckpt")
    assert sorted(ours) == sorted(ddp) == ["critic", "d_opt", "g_opt", "generator", "step"]
    for module in ("generator", "critic"):
        assert ours[module].keys() == ddp[module].keys()
        for name, value in ddp[module].items():
            close(ours[module][name], value, f"{module}.{name}", FP32)
    for optimizer in ("g_opt", "d_opt"):
        assert ours[optimizer]["param_groups"] == ddp[optimizer]["param_groups"]


# --- in this process: the errors of setting up several modules -------------------------------------------------------


@pytest.fixture
def fabric() -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero2")
    fabric.launch()  # one process: this one
    return fabric


def test_an_optimizer_of_two_modules_is_refused(fabric: Fabric) -> None:
    first, second = fabric.setup_module(torch.nn.Linear(4, 4)), fabric.setup_module(torch.nn.Linear(4, 4))
    both = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.raises(RuntimeError, match=r"updates parameters of `Linear` and `Linear`\. HINT: .*one optimizer per"):
        fabric.setup_optimizers(both)
    with pytest.raises(RuntimeError, match=r"updates parameters of none of them\. HINT: call `fabric.setup_module"):
        fabric.setup_optimizers(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_modules_named_with_a_dot_are_refused_in_a_state_of_several(fabric: Fabric, tmp_path: Path) -> None:
    first, second = fabric.setup_module(torch.nn.Linear(4, 4)), fabric.setup_module(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"names some \['model.g'\].*HINT: name the modules without dots"):
        fabric.save(tmp_path / "checkpoint", {"model.g": first, "d": second})


def test_a_second_module_with_its_own_fp16_loss_scaler_is_refused() -> None:
    """fp16 master weights in stages 1 and 2 scale the loss with a scaler of the module's shards; the precision plugin
    multiplies the loss by one, so a second such module is refused rather than trained unscaled."""
    strategy = Zero2Strategy(master_weights=True, sharded_on_one_device=True)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="16-true")
    fabric.launch()
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    fabric.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"one module only\. HINT: train several modules with `precision='bf16"):
        fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
