"""Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file, on any machine.

No process group and no GPU are needed. Each tensor is assembled whole, straight into the output, from the pieces the
shard files hold, so reading never holds more than the output plus the piece being read: about the weights for
``weights_only``, and the whole checkpoint (weights and optimizer state) otherwise, since the output is one
``torch.save`` file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightning_zero._checkpoint import publish
from lightning_zero._checkpoint.source import open_checkpoint
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
    source = open_checkpoint(Path(checkpoint_dir), unpickling=unpickling)
    checkpoint = source.whole(optimizer_states=not weights_only, progress=progress)
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
    state = open_checkpoint(path, unpickling=unpickling).whole(optimizer_states=False)["state_dict"]
    chosen = {name[len(prefix) :]: value for name, value in state.items() if name.startswith(prefix)}
    if not chosen:
        heads = sorted({name.split(".")[0] + "." for name in state})
        raise KeyError(
            f"No weights in {str(path)!r} start with prefix={prefix!r}. HINT: the checkpoint's names start with"
            f" {heads}: pass the attribute your LightningModule holds the model under, with its dot."
        )
    return chosen
