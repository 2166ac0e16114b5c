"""Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file, on any machine.

No process group and no GPU are needed. Tensors are read one at a time, each assembled whole from the shard files
that hold its pieces, so reading never holds more than the output plus one tensor being assembled: about the
weights for ``weights_only``, and the whole checkpoint (weights and optimizer state) otherwise, since the output is
one ``torch.save`` file.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zero._checkpoint import directory as ckpt
from lightning_zero._checkpoint.live import SHARDED_KEYS


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike, *, weights_only: bool = False
) -> Path:
    """Write the checkpoint at ``checkpoint_dir`` as one Lightning checkpoint file with full fp32-or-native weights.

    The result loads with ``MyModule.load_from_checkpoint(output_file)`` and resumes with a plain ``Trainer`` (or any
    ZeRO stage). ``weights_only=True`` leaves out optimizer state, for inference or fine-tuning.
    """
    path = Path(checkpoint_dir)
    meta, metadata = ckpt.read_meta(path)
    checkpoint: dict[str, Any] = dict(meta["checkpoint"])
    checkpoint["state_dict"] = {fqn: _read(path, ckpt.MODEL + fqn, metadata) for fqn in ckpt.model_state_keys(metadata)}
    if not weights_only:
        checkpoint["optimizer_states"] = [
            _optimizer_state(path, index, groups, meta["sharded"].get(index, {}), metadata)
            for index, groups in sorted(meta["param_groups"].items())
        ]
    else:
        for key in ("optimizer_states", "lr_schedulers"):
            checkpoint.pop(key, None)
    output = Path(output_file)
    staging = output.with_name(f".{output.name}.partial")
    torch.save(checkpoint, staging)
    staging.replace(output)  # never a half-written output file
    return output


def _read(path: Path, key: str, metadata: Any) -> Any:
    entry = metadata.state_dict_metadata[key]
    if isinstance(entry, TensorStorageMetadata):
        value: Any = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    else:
        value = None
    holder = {key: value}
    with warnings.catch_warnings():  # DCP says it assumes one process; that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(holder, checkpoint_id=path, no_dist=True)
    return holder[key]


def _optimizer_state(
    path: Path, index: int, groups: list[dict[str, Any]], sharded: dict[str, list[str]], metadata: Any
) -> dict[str, Any]:
    prefix = ckpt.optim_prefix(index) + "state/"
    named: dict[str, dict[str, Any]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            fqn, name = key[len(prefix) :].rsplit("/", 1)
            named.setdefault(fqn, {})[name] = _read(path, key, metadata)
    state_dict, position = ckpt.indexed_optimizer_state({"state": named, "param_groups": groups})
    state_dict[SHARDED_KEYS] = {position[fqn]: keys for fqn, keys in sharded.items()}
    return state_dict
