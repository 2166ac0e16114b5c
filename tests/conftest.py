import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's `tests` package

from tests.launch import RENDEZVOUS

_AT_START = {name: os.environ.get(name) for name in RENDEZVOUS}

# Tests whose verdicts depend on time or on memory a limit counts: stall windows, timeouts, SIGSTOP and kills at a
# moment, memory groups and page-cache residency. They are marked `serial`, and the suite runs them alone after the
# rest has run on two workers (the README's command), so that another test's load never moves them.
SERIAL = {
    "test_checkpoint_saves.py", "test_divergent.py", "test_faults.py",
    "test_infinity_memory.py", "test_launch.py", "test_page_cache.py", "test_shared_memory.py",
    "test_stalls.py", "test_watchdog.py",
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)


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
