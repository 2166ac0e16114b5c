"""Runs inside each of N processes (started by tests/launch.py) for tests/test_launch.py; ``argv``: the directory,
whose payload names the :class:`~tests.launch.Probe` to act out. It imports nothing but the standard library and
tests.launch, so that every rank is running within a fraction of a second (the tests' timeouts are seconds).

- ``RANK1_FAILS``: rank 0 joins the process group and waits in a barrier that rank 1 never reaches, as a rank does
  whose peer crashed; rank 1 raises once rank 0 is running (it wrote its process id).
- ``ALL_BLOCK``: every rank sleeps far past any test's timeout.
- ``SUCCEED``: every rank prints a line and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.launch import Probe, read_payload


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    match read_payload(out)["phase"], rank:
        case Probe.RANK1_FAILS, 0:
            import torch.distributed as dist

            (out / "rank0.pid").write_text(str(os.getpid()))  # imported: what remains is the rendezvous, which blocks
            dist.init_process_group("gloo")
            dist.barrier()
        case Probe.RANK1_FAILS, 1:
            deadline = time.monotonic() + 60
            while not (out / "rank0.pid").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("rank 1 gives up at once")
        case Probe.ALL_BLOCK, _:
            (out / f"rank{rank}.pid").write_text(str(os.getpid()))
            time.sleep(300)
        case Probe.SUCCEED, _:
            print(f"rank {rank} done")
        case probe, _:
            raise ValueError(probe)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
