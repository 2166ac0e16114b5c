import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's `tests` package

from tests.launch import RENDEZVOUS

_AT_START = {name: os.environ.get(name) for name in RENDEZVOUS}


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo group of one rank in this process, for a layer's tests without processes."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """A Trainer or Fabric run inside the pytest process (one device) sets rendezvous variables and a process group;
    later tests start processes of their own (launchers, a Jupyter kernel) that must find neither. The variables go
    back to what the session started with, not to what the test started with: a module's fixture that ran before the
    test set them (a listening port that a later test's ranks would find taken)."""
    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    for name, value in _AT_START.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
