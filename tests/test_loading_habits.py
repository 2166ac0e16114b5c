"""How users load and hand weights around in a Fabric loop, against Fabric's ``"ddp"`` on 2 and 3 processes: whole
state dicts into ``model.load_state_dict`` (after an evaluation's forward, which leaves stage 3's root gathered),
``fabric.load_raw`` of a module's file (raw or a Lightning checkpoint) and of an optimizer's, ``fabric.load`` of a
file after an evaluation, and ``fabric.load`` of a checkpoint with and without a ``state``.

Loading is exact: what a load leaves in the module is the file's tensors bit for bit, under every strategy. The step
after each load is compared with ``"ddp"``'s within the fp32 parity tolerance of tests/oracle.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launch import launch
from tests.oracle import FP32, close
from tests.scenarios import read_results, write_payload
from tests.workers.loading_habits import other_weights
from tests.workers.modules import Classifier

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
LOADED = {"load_state_dict": 1, "load_raw": 2, "load_raw_lightning_file": 3, "load_after_evaluation": 4}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp(f"loading{request.param}")
    write_payload(out, strategies=STRATEGIES)
    launch("tests.workers.loading_habits", [str(out)], request.param)
    return out, request.param


@pytest.fixture(scope="module")
def results(run_dir: tuple[Path, int]) -> list[dict[str, Any]]:
    return read_results(*run_dir)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loads_leave_the_files_weights_exactly(results: list[dict[str, Any]], strategy: str) -> None:
    torch.manual_seed(0)
    shapes = Classifier()
    for rank, per_rank in enumerate(results):
        for moment, seed in LOADED.items():
            expected = other_weights(shapes, seed)
            loaded = per_rank[strategy][moment]
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), f"rank {rank} {strategy} {moment} {key}"


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_loading_continues_as_ddp(results: list[dict[str, Any]], strategy: str) -> None:
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[strategy], per_rank["ddp"]
        what = f"rank {rank} {strategy}"
        assert len(ours["losses"]) == len(ddp["losses"]) == 1 + len(LOADED)
        close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), f"{what} losses", FP32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_raw_leaves_the_optimizer_files_state_exactly(
    run_dir: tuple[Path, int], results: list[dict[str, Any]], strategy: str
) -> None:
    """Each rank keeps its shard of every whole tensor; gathered, they are the file's, bit for bit."""
    saved = torch.load(run_dir[0] / "files" / "optimizer.pt")["state"]
    for rank, per_rank in enumerate(results):
        loaded = per_rank[strategy]["load_raw_optimizer"]
        assert loaded.keys() == saved.keys()
        for index, entries in saved.items():
            assert loaded[index].keys() == entries.keys()
            for key, value in entries.items():
                assert torch.equal(loaded[index][key], value), f"rank {rank} {strategy} state[{index}][{key}]"


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_load_returns_what_ddp_returns(results: list[dict[str, Any]], strategy: str) -> None:
    """``fabric.load(path)`` returns the checkpoint under the names it was saved with; with a ``state``, only the
    user's entries beyond it (none the checkpoint format added)."""
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[strategy]["load_without_state"], per_rank["ddp"]["load_without_state"]
        assert ours["keys"] == ddp["keys"] == ["iter_num", "model", "optimizer"]
        assert ours["iter_num"] == ddp["iter_num"] == 7
        assert ours["optimizer_steps"] == ddp["optimizer_steps"]
        assert ours["model"].keys() == ddp["model"].keys()
        for key, value in ddp["model"].items():
            close(ours["model"][key], value, f"rank {rank} {strategy} {key}", FP32)
        assert per_rank[strategy]["load_rest"] == per_rank["ddp"]["load_rest"] == {"iter_num": 7}


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_misdirected_loads_name_the_call_to_make(results: list[dict[str, Any]], strategy: str) -> None:
    """``fabric.load`` of a raw state-dict file points at ``fabric.load_raw``, and ``fabric.load_raw`` of a checkpoint
    directory at ``fabric.load``, naming the path."""
    for per_rank in results:
        raw_file, directory = per_rank[strategy]["misdirected"]
        assert "raw.pt" in raw_file and "fabric.load_raw(path, model)" in raw_file
        assert ".ckpt is a checkpoint directory" in directory and "fabric.load(path, {'model': model" in directory
