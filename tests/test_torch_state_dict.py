"""torch's ``torch.distributed.checkpoint.state_dict`` on the module and optimizer a Fabric strategy returns, against
Fabric's ``"ddp"`` on 2 and 3 processes: ``get_model_state_dict``/``get_optimizer_state_dict`` with
``StateDictOptions(full_state_dict=True, cpu_offload=True)`` give rank 0 the whole tensors (other ranks nothing), and
``set_model_state_dict``/``set_optimizer_state_dict`` of whole tensors, held by every rank or by rank 0 alone with
``broadcast_from_rank0=True``, leave exactly those in the module and optimizer; training then continues as under
``"ddp"`` (fp32 parity tolerance of tests/oracle.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import launch
from tests.oracle import FP32, close
from tests.scenarios import read_results, write_payload
from tests.workers.torch_state_dict import other_state

pytestmark = pytest.mark.slow  # every test here launches processes

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "zero2_master"]
FP32_RUNS = STRATEGIES[:4]  # "zero2_master" trains in bf16: no parity with fp32 "ddp"
SETS = {"every_rank": 1, "from_rank_zero": 2}  # how the whole state was handed over, and its seed


# 3 ranks: every parameter's rows split unevenly (2 ranks split them evenly, as the parity tests run)
@pytest.fixture(scope="module", params=[3], ids=lambda n: f"{n}ranks")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"torch_state_dict{request.param}")
    write_payload(out, strategies=STRATEGIES)
    launch("tests.workers.torch_state_dict", [str(out)], request.param)
    return read_results(out, request.param)


def names_of(state: dict[str, Any]) -> list[str]:
    return list(state["state"])


@pytest.mark.parametrize("strategy", FP32_RUNS)
def test_full_state_dicts_are_whole_on_rank_zero_alone(results: list[dict[str, Any]], strategy: str) -> None:
    """What the getters give rank 0 is the trained state, bit for bit; the other ranks get empty dicts."""
    for rank, per_rank in enumerate(results):
        got, trained = per_rank[strategy]["got"], per_rank[strategy]["trained"]
        if rank > 0:
            assert got == {"model": {}, "optimizer": {}}
            continue
        assert got["model"].keys() == trained["weights"].keys()
        for key, value in trained["weights"].items():
            assert got["model"][key].device.type == "cpu"
            assert torch.equal(got["model"][key], value), key
        names = list(got["model"])  # the parameters in the optimizer's order: all of them, no buffers here
        assert names_of(got["optimizer"]) == names
        for index, entries in trained["optimizer"].items():
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(got["optimizer"]["state"][names[index]][key]), value), (index, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("handed_over", SETS)
def test_setting_full_state_dicts_leaves_them_exactly(
    results: list[dict[str, Any]], strategy: str, handed_over: str
) -> None:
    weights, optimizer_state = other_state(SETS[handed_over])
    names = list(optimizer_state["state"])
    for rank, per_rank in enumerate(results):
        after = per_rank[strategy][handed_over]
        what = f"rank {rank} {strategy} {handed_over}"
        assert after["weights"].keys() == weights.keys()
        for key, value in weights.items():
            loaded = after["weights"][key]
            assert torch.equal(loaded, value.to(loaded.dtype)), f"{what} {key}"  # bf16 weights: rounded once
            assert torch.equal(after["masters"][key], loaded.float()), f"{what} {key}: the master follows the weight"
        for index, name in enumerate(names):
            for key, value in optimizer_state["state"][name].items():
                assert torch.equal(after["optimizer"][index][key], value), f"{what} {name} {key}"


@pytest.mark.parametrize("strategy", FP32_RUNS[1:])
def test_training_after_setting_continues_as_ddp(results: list[dict[str, Any]], strategy: str) -> None:
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[strategy]["losses"], per_rank["ddp"]["losses"]
        assert len(ours) == len(ddp) == 1 + len(SETS)
        close(torch.tensor(ours), torch.tensor(ddp), f"rank {rank} {strategy} losses", FP32)
