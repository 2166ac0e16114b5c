"""Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file, on any machine.

No process group and no GPU are needed. Tensors are read one at a time, each assembled whole from the shard files
that hold its pieces, so reading never holds more than the output plus one tensor being assembled: about the
weights for ``weights_only``, and the whole checkpoint (weights and optimizer state) otherwise, since the output is
one ``torch.save`` file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_zero import _progress
from lightning_zero._checkpoint import directory as ckpt
from lightning_zero._checkpoint import keys, publish
from lightning_zero._checkpoint.deepspeed import read_deepspeed_checkpoint
from lightning_zero._checkpoint.deepspeed_files import is_deepspeed_checkpoint
from lightning_zero._checkpoint.unpickling import Unpickling


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike,
    output_file: str | os.PathLike,
    *,
    weights_only: bool = False,
    trust_pickle: bool = False,
    progress: bool = True,
) -> Path:
    """Write the checkpoint at ``checkpoint_dir`` as one Lightning checkpoint file with full fp32-or-native weights.
    ``checkpoint_dir`` is this package's checkpoint directory or a DeepSpeed ZeRO checkpoint (a save directory with
    ``latest``, one tag directory in it, or a ``.ckpt`` directory of Lightning's ``DeepSpeedStrategy``), whose
    fp32 master weights and optimizer state come out whole, as this package's would.

    The result loads with ``MyModule.load_from_checkpoint(output_file)`` and resumes with a plain ``Trainer`` (or any
    ZeRO stage). ``weights_only=True`` leaves out optimizer state, for inference or fine-tuning.

    Every file is checked against the checksums recorded when it was written, and nothing is unpickled but tensors,
    plain containers and DCP's own classes: a checkpoint holding other objects (a custom class among the
    hyper-parameters, say) raises :class:`CheckpointError` naming them. ``trust_pickle=True`` lets such a checkpoint
    import and run what its pickles name, as ``torch.load(weights_only=False)`` does: only for checkpoints you trust.
    The shard files are checked while they are read, and nothing is written before every check has passed; the
    output is never half-written (see :func:`~lightning_zero._checkpoint.publish.publish_file`).

    While it reads, a progress bar is drawn on stderr if stderr is a terminal (never into a log or a pipe);
    ``progress=False`` leaves it out there too.
    """
    unpickling = Unpickling.TRUSTED if trust_pickle else Unpickling.RESTRICTED
    checkpoint = whole_checkpoint(Path(checkpoint_dir), unpickling, weights_only=weights_only, progress=progress)
    output = Path(output_file)
    publish.publish_file(output, lambda file: torch.save(checkpoint, file))  # never a half-written output file
    return output


def whole_state_dict(
    checkpoint: str | os.PathLike, *, prefix: str = "", trust_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """The module weights of a Trainer checkpoint, whole, in this process: the entries of its ``state_dict`` whose
    names start with ``prefix``, without it. ``checkpoint``: this package's checkpoint directory, a DeepSpeed
    checkpoint, or a Lightning checkpoint file. For handing a submodule to its library, e.g. a Hugging Face model held
    as ``self.model``::

        model = GPT2LMHeadModel(config)
        model.load_state_dict(whole_state_dict("last.ckpt", prefix="model."))
        model.save_pretrained("gpt2-finetuned")

    ``trust_pickle``: as for :func:`consolidate_checkpoint`.
    """
    path = Path(checkpoint)
    unpickling = Unpickling.TRUSTED if trust_pickle else Unpickling.RESTRICTED
    if path.is_dir():
        state = whole_checkpoint(path, unpickling, weights_only=True)["state_dict"]
    else:
        state = torch.load(path, map_location="cpu", weights_only=not trust_pickle)["state_dict"]
    chosen = {name[len(prefix) :]: value for name, value in state.items() if name.startswith(prefix)}
    if not chosen:
        heads = sorted({name.split(".")[0] + "." for name in state})
        raise KeyError(
            f"No weights in {str(path)!r} start with prefix={prefix!r}. HINT: the checkpoint's names start with"
            f" {heads}: pass the attribute your LightningModule holds the model under, with its dot."
        )
    return chosen


def whole_checkpoint(
    checkpoint_dir: Path, unpickling: Unpickling, *, weights_only: bool = False, progress: bool = False
) -> dict[str, Any]:
    """The checkpoint at ``checkpoint_dir`` (this package's or DeepSpeed's) as one Lightning checkpoint dict of whole
    tensors, read in this process alone (see :func:`consolidate_checkpoint`); ``progress`` draws a bar on a terminal
    while it reads."""
    path = ckpt.readable_directory(checkpoint_dir) or checkpoint_dir
    if is_deepspeed_checkpoint(path):
        return read_deepspeed_checkpoint(path, unpickling).lightning_checkpoint(weights_only)
    meta, metadata, shard_check = ckpt.open_checkpoint(path, unpickling=unpickling)
    checkpoint: dict[str, Any] = dict(meta["checkpoint"])
    entries = metadata.state_dict_metadata
    reading = _progress.progress(_bytes_to_read(entries, weights_only), f"reading {path.name}", shown=progress)
    with shard_check.overlapping(), reading as advance:
        read = partial(_read, path, metadata, unpickling, advance)
        checkpoint["state_dict"] = {fqn: read(keys.model_key(fqn)) for fqn in keys.model_entries(entries)}
        if not weights_only:
            indices = sorted(meta["param_groups"])
            named_states = [_optimizer_state(read, i, meta["param_groups"][i], metadata) for i in indices]
            shapes = {fqn: value.shape for fqn, value in checkpoint["state_dict"].items()}
            # `"ddp"`'s optimizer states, and a record beside them only where the rule would not tell
            sharded = [meta["sharded"].get(i, {}) for i in indices]
            records = [keys.file_record(s, named, shapes) for s, named in zip(sharded, named_states, strict=True)]
            checkpoint["optimizer_states"] = [keys.indexed_optimizer_state(named)[0] for named in named_states]
            if any(record is not None for record in records):
                checkpoint[keys.SHARDED_KEYS] = records
    if weights_only:
        for key in ("optimizer_states", "lr_schedulers"):
            checkpoint.pop(key, None)
    return checkpoint


def _read(path: Path, metadata: Metadata, unpickling: Unpickling, advance: Callable[[int], object], key: str) -> Any:
    entry = metadata.state_dict_metadata[key]
    if isinstance(entry, TensorStorageMetadata):
        value: Any = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    else:
        value = None
    holder = {key: value}
    with warnings.catch_warnings():  # DCP says it assumes one process; that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        ckpt.load(holder, path, metadata, unpickling, no_dist=True)
    advance(_nbytes(entry))
    return holder[key]


def _bytes_to_read(entries: dict[str, Any], weights_only: bool) -> int:
    """The tensor bytes consolidation reads: the model's, and with the optimizer state every other entry's."""
    wanted = {keys.model_key(fqn) for fqn in keys.model_entries(entries)} if weights_only else entries.keys()
    return sum(_nbytes(entries[key]) for key in wanted)


def _nbytes(entry: Any) -> int:
    if not isinstance(entry, TensorStorageMetadata):
        return 0  # a pickled object: small beside the tensors
    return entry.size.numel() * entry.properties.dtype.itemsize


def _optimizer_state(
    read: Callable[[str], Any], index: int, groups: list[dict[str, Any]], metadata: Any
) -> dict[str, Any]:
    """Optimizer ``index``'s state, whole and named (see :func:`.keys.named_optimizer_state`)."""
    named: dict[str, dict[str, Any]] = {}
    for key, fqn, name in keys.optimizer_entries(metadata.state_dict_metadata, index):
        named.setdefault(fqn, {})[name] = read(key)
    return {"state": named, "param_groups": groups}
