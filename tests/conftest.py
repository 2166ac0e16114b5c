import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """A Trainer run inside the pytest process (one device) sets rendezvous variables and a process group; later
    tests start processes of their own (launchers, a Jupyter kernel) that must find neither."""
    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
