"""The block-wise quantization ZeRO++'s collectives send between nodes (lightning_zero/_transport/quantize.py): each
element within half its block's step, non-finite blocks kept non-finite, the packed size as stated. The collectives
themselves run in tests/test_hybrid.py's launch."""

from __future__ import annotations

import pytest
import torch

from lightning_zero._transport.quantize import BLOCK, INT4, INT8, Format, dequantize, quantize


@pytest.mark.parametrize("form", [INT8, INT4], ids=["int8", "int4"])
def test_each_element_within_half_a_step_of_its_block(form: Format) -> None:
    rows = torch.randn(3, 1000) * torch.logspace(-4, 4, 1000)  # blocks of very different scales, a partial last one
    back = dequantize(quantize(rows, form), form, torch.empty_like(rows))
    padded = torch.nn.functional.pad(rows, (0, -rows.shape[1] % BLOCK)).view(3, -1, BLOCK)
    half_step = (padded.abs().amax(dim=2) / form.levels / 2).repeat_interleave(BLOCK, dim=1)[:, : rows.shape[1]]
    assert ((rows - back).abs() <= half_step * (1 + 1e-6)).all()
    assert quantize(rows, form).shape[1] == form.packed_bytes(1000) == 4 * BLOCK // form.per_byte + 4 * 4


def test_a_non_finite_block_stays_non_finite_and_zeros_stay_zero() -> None:
    rows = torch.zeros(1, 3 * BLOCK)
    rows[0, BLOCK + 5] = float("inf")
    rows[0, 2 * BLOCK :] = 0.5
    back = dequantize(quantize(rows, INT8), INT8, torch.empty_like(rows))
    assert (back[0, :BLOCK] == 0).all()
    assert not back[0, BLOCK : 2 * BLOCK].isfinite().any()  # a loss scaler still sees the overflow
    assert (back[0, 2 * BLOCK :] == 0.5).all()
