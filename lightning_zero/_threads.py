"""Work on a thread of its own that can fail to start without hanging its caller: the package's background threads
(the checksums of a save and of a load) start here, never through ``threading.Thread.start``.

``Thread.start`` waits, without a limit, for the new thread to say that it runs. Where memory is short (a process
at its ``RLIMIT_AS``, a container near its limit), the operating system can still create the thread (glibc reuses
the stack of one that ended) while Python cannot give it its first frame: the new thread prints ``Exception ignored
in thread started by`` and a ``MemoryError``, and ends without saying so, and its starter waits forever. A rank
stuck there never raises, so its peers wait the whole collective timeout (30 minutes by default) for it. Here the
caller waits :data:`START_SECONDS` at most for the thread to begin, then raises ``MemoryError``, which ends the
rank, and so every rank, within seconds.
"""

from __future__ import annotations

import _thread
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

# how long a new thread may take to run its first line: microseconds, milliseconds on a loaded machine
START_SECONDS = 5.0


def in_thread(work: Callable[[], T]) -> Future[T]:
    """``work()`` running on a new thread, its result or exception in the future returned; the thread ends as soon
    as the future is done. Raises ``MemoryError`` when the thread did not begin within :data:`START_SECONDS`."""
    future: Future[T] = Future()
    began = _thread.allocate_lock()
    began.acquire()

    def run() -> None:
        began.release()
        if not future.set_running_or_notify_cancel():  # began too late: its starter has already raised
            return
        try:
            future.set_result(work())
        except BaseException as error:  # the caller raises it, whatever it is
            future.set_exception(error)

    _thread.start_new_thread(run, ())
    if not began.acquire(timeout=START_SECONDS) and future.cancel():
        raise MemoryError(
            f"A new thread did not begin within {START_SECONDS:g} s: this process is out of memory (its address-space"
            " limit, `ulimit -v`, or its container's). HINT: give the job more memory or use a smaller batch."
        )
    return future
