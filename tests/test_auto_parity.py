"""``zero_auto`` against the strategy it chose, named by hand: 2 CPU ranks, the same seeded classifier, the same 6
steps. The choice is that strategy, so losses, parameters and optimizer state must be equal exactly, not within a
tolerance. One pair of processes runs every case (tests/workers/auto_parity.py): two budgets, a module built under
``trainer.init_module()``, and a Fabric loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import launch

pytestmark = pytest.mark.slow  # launches processes


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("auto_parity")
    launch("tests.workers.auto_parity", [str(out)], 2)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("measured", "zero2_offload"),  # CPU ranks stepping Adam: the host step (torch's fused kernel) first
        ("room_for_stage_2", "zero2"),  # no offload
        ("init_module", "zero2_offload"),
        ("fabric", "zero2_offload"),
    ],
)
def test_zero_auto_equals_its_choice_named_by_hand(results: list[dict[str, Any]], case: str, expected: str) -> None:
    for rank, ranks_results in enumerate(results):
        run = ranks_results[case]
        assert run["chosen"] == expected
        assert len(run["auto"]["losses"]) == 6
        assert_equal(run["auto"], run["by_hand"], f"rank {rank}, {case}")
