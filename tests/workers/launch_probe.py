"""Runs inside each of N processes (started by tests/launch.py) for tests/test_launch.py; ``argv``: behaviour, dir.

- ``rank1_fails``: rank 0 joins the process group and waits in a barrier that rank 1 never reaches, as a rank does
  whose peer crashed; rank 1 raises once rank 0 is running (it wrote its process id).
- ``all_block``: every rank sleeps far past any test's timeout.
- ``succeed``: every rank prints a line and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(behaviour: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    match behaviour, rank:
        case "rank1_fails", 0:
            import torch.distributed as dist

            (out / "rank0.pid").write_text(str(os.getpid()))  # imported: what remains is the rendezvous, which blocks
            dist.init_process_group("gloo")
            dist.barrier()
        case "rank1_fails", 1:
            deadline = time.monotonic() + 60
            while not (out / "rank0.pid").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("rank 1 gives up at once")
        case "all_block", _:
            (out / f"rank{rank}.pid").write_text(str(os.getpid()))
            time.sleep(300)
        case "succeed", _:
            print(f"rank {rank} done")
        case _:
            raise ValueError(behaviour)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
