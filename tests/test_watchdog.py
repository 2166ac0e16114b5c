"""The stall watchdog's parts without processes: the ``stall_after`` option in both front ends, and the verdict a
round of answers gives (tests/test_stalls.py runs it between real ranks)."""

from __future__ import annotations

import pytest

from lightning_zero import ZeroStrategy
from lightning_zero._config import ZeroConfig
from lightning_zero._transport.activity import Place
from lightning_zero._transport.labels import DivergedError
from lightning_zero._transport.peers import PeerError
from lightning_zero._transport.watchdog import _error, _verdict_of
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy

TICK = 1.0
GATHER = "the all-gather of unit `h.0` of Net's parameters"
STEP_ENDED = "the end of a forward of the whole module"


def answer(place: Place, doing: str = GATHER, seconds: float = 60.0, call: str = "", signal: str = "") -> dict:
    return {"doing": doing, "place": place.value, "where": "train.py:12 (step)", "call": call, "seconds": seconds,
            "pid": 1, "host": "h", "signal": signal}


def test_stall_after_is_an_option_of_both_front_ends() -> None:
    assert ZeroStrategy(stage=3, stall_after=5).config.stall_after == 5.0
    assert FabricZeroStrategy(stage=3, stall_after=7.5).config.stall_after == 7.5
    assert ZeroStrategy(stage=3).config.stall_after == 60.0


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "60"])
def test_a_bad_stall_after_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"`stall_after=.*` must be a finite, positive number of seconds\. HINT:"):
        ZeroConfig.from_options(stage=3, stall_after=value)


def test_ranks_waiting_in_different_collectives_diverged() -> None:
    found = _verdict_of({0: answer(Place.LEFT, STEP_ENDED), 1: answer(Place.WAITING)}, 2, TICK)
    assert found is not None and found["kind"] == "diverged"
    error = _error(found, 1)
    assert isinstance(error, DivergedError)
    assert f"(seen on rank 1): rank 0: {STEP_ENDED}, then the end of its script" in str(error)
    assert f"rank 1: {GATHER} (waiting in it for 60 s)" in str(error)
    assert "needs `synced_gpus=True`" in str(error)


def test_a_rank_in_torchs_collective_and_one_in_a_gather_diverged() -> None:
    answers = {0: answer(Place.TORCH, STEP_ENDED, call="broadcast"), 1: answer(Place.WAITING)}
    found = _verdict_of(answers, 2, TICK)
    assert found is not None and found["kind"] == "diverged"
    assert "then torch's `broadcast` called at train.py:12 (step)" in str(_error(found, 0))


@pytest.mark.parametrize(
    "other",
    [answer(Place.BUSY, seconds=60.0), answer(Place.WAITING, "the all-gather of unit `h.1`", seconds=0.2)],
    ids=["busy", "just-arrived"],
)
def test_a_busy_or_just_arrived_rank_is_waited_for(other: dict) -> None:
    """A peer computing (slower, not stuck), or one that entered its collective less than a tick ago (still moving
    through its collectives), gives no verdict: the round is asked again later."""
    assert _verdict_of({0: answer(Place.WAITING), 1: other}, 2, TICK) is None


def test_ranks_waiting_in_the_same_collective_give_no_verdict() -> None:
    assert _verdict_of({0: answer(Place.WAITING), 1: answer(Place.WAITING)}, 2, TICK) is None


def test_a_rank_that_does_not_answer_is_named() -> None:
    found = _verdict_of({0: answer(Place.WAITING)}, 2, TICK)
    assert found is not None and found["kind"] == "peer" and found["missing"] == [1]
    error = _error(found, 0)
    assert isinstance(error, PeerError)
    assert "rank 1 did not answer within 5 s" in str(error)
    assert f"Where the others are: rank 0: {GATHER} (waiting in it for 60 s)" in str(error)


def test_a_signalled_rank_stops_every_rank() -> None:
    answers = {0: answer(Place.TORCH, STEP_ENDED, call="broadcast", signal="SIGTERM"), 1: answer(Place.WAITING)}
    found = _verdict_of(answers, 2, TICK)
    assert found is not None
    assert "rank 0 received SIGTERM while blocked in a collective" in str(_error(found, 1))
