"""``whole_state_dict`` on a Lightning checkpoint file, in one process (a zero3 directory into a Hugging Face
``save_pretrained`` folder is in tests/test_hf_models.py): the entries under the prefix, without it; a prefix that
matches nothing is an error naming the checkpoint's own prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero import whole_state_dict


def test_entries_under_the_prefix_without_it(tmp_path: Path) -> None:
    weights = {"model.wte.weight": torch.randn(3, 2), "model.ln.bias": torch.randn(2), "head.weight": torch.randn(2)}
    torch.save({"state_dict": weights, "global_step": 4}, tmp_path / "last.ckpt")
    chosen = whole_state_dict(tmp_path / "last.ckpt", prefix="model.")
    assert chosen.keys() == {"wte.weight", "ln.bias"}
    assert torch.equal(chosen["wte.weight"], weights["model.wte.weight"])
    assert whole_state_dict(tmp_path / "last.ckpt").keys() == weights.keys()
    hint = r"prefix='net\.'.*HINT: the checkpoint's names start with \['head\.', 'model\.'\]"
    with pytest.raises(KeyError, match=hint):
        whole_state_dict(tmp_path / "last.ckpt", prefix="net.")
