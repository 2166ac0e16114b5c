"""A full checkpoint file records its checksums in ``torch.save``'s own zip directory (the CRC-32 of every record),
and every load of an ordinary file checks them before unpickling it: damage is named, not loaded. In one process,
with real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero import CheckpointError
from lightning_zero._checkpoint.whole import check_file, write_file


def written(path: Path) -> Path:
    write_file(path, {"state_dict": {"w": torch.arange(4096, dtype=torch.float32)}, "global_step": 3})
    return path


def test_an_intact_file_passes_and_loads(tmp_path: Path) -> None:
    path = written(tmp_path / "sub" / "model.ckpt")  # its directory is created, as Lightning's checkpoint IO does
    check_file(path)
    assert torch.equal(torch.load(path)["state_dict"]["w"], torch.arange(4096, dtype=torch.float32))


def test_a_flipped_bit_is_named_with_its_record(tmp_path: Path) -> None:
    path = written(tmp_path / "model.ckpt")
    data = bytearray(path.read_bytes())
    offset = data.find(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[400:432])
    data[offset + 3] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.ckpt is damaged: its record `.*data/0`"):
        check_file(path)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = written(tmp_path / "model.ckpt")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.ckpt is truncated"):
        check_file(path)


def test_files_without_checksums_pass_unchecked(tmp_path: Path) -> None:
    """A file written with torch's checksums turned off, or in torch's legacy format, has nothing to check against."""
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(3)}, tmp_path / "no_crc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("no_crc.pt", "legacy.pt"):
        check_file(tmp_path / name)
        assert torch.equal(torch.load(tmp_path / name)["w"], torch.ones(3))
