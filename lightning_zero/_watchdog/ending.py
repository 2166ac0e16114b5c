"""Ending a process whose main thread stays blocked after its collective was released: a call no release reaches
(native code of the user's, a backend the release leaves alone) would otherwise keep the rank, and so the job, alive
past its verdict.

Words used below:

- *grace*: :data:`GRACE_SECONDS` from the release; a main thread still in the frame call it was blocked in by then is
  stuck, and the process ends with status 1 (``128 + N`` after signal N), after what the exit hook would do that
  matters to others: the shared memory unmapped with a farewell (a peer waiting in a channel fails at once), the ranks
  this process started ended.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from lightning_zero._transport import launched, shared_memory

GRACE_SECONDS = 10.0
FrameKey = tuple[int, int, int]  # what `activity.sample()` says of the main thread's innermost call


@dataclass
class Released:
    """The main thread's call when its collective was released, and when."""

    blocked_in: FrameKey | None  # None once it moved on
    since: float

    def stuck(self, frame_key: FrameKey) -> bool:
        """Whether the main thread, now in ``frame_key``, is still in the released call after the grace."""
        if frame_key != self.blocked_in:
            self.blocked_in = None  # it moved on: it raises, as it should
        return self.blocked_in is not None and time.monotonic() - self.since >= GRACE_SECONDS


def end_process(status: int) -> NoReturn:
    """Leave now with ``status``, after closing the shared memory (as failed) and ending the ranks this process
    started."""
    with contextlib.suppress(Exception):
        shared_memory.close_all(failed=True)
    launched.end_started_ranks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
