"""Gradient clipping in a LitGPT-style Fabric loop saved after 3 steps and resumed for 3 more
(``tests/workers/clip_resume.py``), against ``"ddp"``: what differs under stages 2 and 3, why, and by how much.

Zero1 clips the full gradients ``"ddp"`` clips: the same bits. Stages 2 and 3 hold each parameter's gradient as this
rank's shard (a DTensor), and ``clip_grad_norm_`` computes its norm as ``sqrt(sum over ranks of |shard|^2)`` where
``"ddp"`` computes ``|whole gradient|``: the same real number rounded along another path. With up to
``m = 3 * 32 * 32`` squares summed per parameter in fp32, the rounding of either is within about ``sqrt(m) * u``
(``u = 2**-24``, Higham's probabilistic bound: 6e-6) of the true norm; :data:`NORM_RTOL` allows 1e-5. Measured: the
total norm differs in its last bit at some steps, equal at the others. That is the only difference: the losses are
equal bit for bit up to the step after the first differing norm (the resume itself changes nothing: a straight 6-step
run measures the same).

A clip coefficient ``max_norm / norm`` off by a relative ``delta <= NORM_RTOL`` scales every gradient by ``1 + delta``,
which Adam's update ``m / (sqrt(v) + eps)`` cancels but for ``eps``: every parameter moves by the same step to within
``lr * delta`` per step (3e-8 over 3 steps), the loss and weights then differing by a few ulps (measured: 6e-8
absolute), hence :data:`WEIGHTS`. Except the attention key biases: the softmax of each query's scores is unchanged by
adding a constant per query, and ``q . b_k`` is one, so their true gradient is zero and the computed one is rounding
noise, which changes entirely when a weight moves by an ulp. Adam normalises any nonzero gradient to a step of up to
``lr * B_t`` (:func:`adam_step_bound`), so their difference is bounded by the sum of two such steps per step after the
first differing norm, ``2 * lr * sum(B_t)`` (:func:`key_bias_bound`); measured: 1.3e-4 (0.13 ``lr``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.launch import launch, write_payload
from tests.oracle import FP32, Tolerance, close
from tests.scenarios import read_results
from tests.workers.clip_resume import LR, MAX_NORM, STEPS, WIDTH

pytestmark = pytest.mark.slow  # launches processes

NORM_RTOL = 1e-5
WEIGHTS = Tolerance(rtol=1e-5, atol=1e-6)
BETAS = (0.9, 0.999)  # AdamW's defaults, which the worker keeps


def adam_step_bound(t: int) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` of Adam's step ``t`` (from 1), whatever the gradients: by Cauchy-Schwarz
    on ``m = (1 - b1) sum_k b1^(t-k) g_k`` against ``v = (1 - b2) sum_k b2^(t-k) g_k^2``, times the bias corrections."""
    b1, b2 = BETAS
    weights = sum((b1 * b1 / b2) ** j for j in range(t))
    return (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2)) * math.sqrt(weights)


def key_bias_bound(first: int, last: int) -> float:
    """Two runs whose gradients for a parameter are unrelated noise from step ``first`` to ``last`` (from 1) differ
    there by at most two of Adam's largest steps per step (weight decay only shrinks a difference)."""
    return sum(2 * LR * adam_step_bound(t) for t in range(first, last + 1))


def test_clipping_after_a_resume_differs_from_ddp_only_by_the_norms_rounding(tmp_path: Path) -> None:
    strategies = ["ddp", "zero1", "zero2", "zero3"]
    write_payload(tmp_path, strategies=strategies, resume=True)
    launch("tests.workers.clip_resume", [str(tmp_path)], 2, timeout=600)
    for rank, results in enumerate(read_results(tmp_path, 2)):
        ddp = results["ddp"]
        assert min(ddp["norms"]) > MAX_NORM, "every step must clip"
        assert results["zero1"]["norms"] == ddp["norms"] and results["zero1"]["losses"] == ddp["losses"]
        for name, param in results["zero1"]["params"].items():
            assert torch.equal(param, ddp["params"][name]), name
        for strategy in ("zero2", "zero3"):
            run = results[strategy]
            assert run["norms"] == pytest.approx(ddp["norms"], rel=NORM_RTOL), (strategy, rank)
            differing = [step for step, (a, b) in enumerate(zip(run["norms"], ddp["norms"], strict=True)) if a != b]
            first = differing[0] if differing else 2 * STEPS
            assert run["losses"][: first + 1] == ddp["losses"][: first + 1], (strategy, rank)
            assert run["losses"] == pytest.approx(ddp["losses"], rel=FP32.rtol, abs=FP32.atol)
            for name, expected in ddp["params"].items():
                actual = run["params"][name]
                if name.endswith("attn.qkv.bias"):  # queries, keys, values: the keys' true gradient is zero
                    keys = torch.arange(3 * WIDTH) // WIDTH == 1
                    bound = key_bias_bound(first + 1, 2 * STEPS)
                    assert (actual[keys] - expected[keys]).abs().max().item() <= bound, (strategy, name, bound)
                    actual, expected = actual[~keys], expected[~keys]
                close(actual, expected, f"{strategy} rank {rank} {name}", WEIGHTS)
