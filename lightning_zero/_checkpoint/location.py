"""Where a checkpoint path points: the local filesystem, named as Lightning names it (a plain path, or an fsspec URL
of the local filesystem, ``local://`` or ``file://``), or somewhere this package does not write to."""

from __future__ import annotations

import os
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import get_protocol

_LOCAL = ("file", "local")  # fsspec's names of the local filesystem


def local_path(path: str | os.PathLike) -> Path:
    """``path`` as a local path: a URL of the local filesystem loses its scheme, as fsspec reads it; any other scheme
    is refused, since checkpoints are written by every rank through the local filesystem (a shared one on several
    nodes)."""
    text = os.fspath(path)
    if "://" not in text:
        return Path(text)
    protocol = get_protocol(text)
    if protocol not in _LOCAL:
        raise ValueError(
            f"Checkpoint path {text!r} names the `{protocol}://` filesystem; the ZeRO strategies write and read"
            " checkpoints on the local filesystem (a shared one across nodes). HINT: pass a local path (or"
            " `local://`/`file://` URL), and copy the checkpoint to remote storage after it is written."
        )
    return Path(LocalFileSystem._strip_protocol(text))
