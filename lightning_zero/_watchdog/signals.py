"""Signals received while the main thread is blocked in native code (a collective), where its own handlers cannot run
until the call returns: Python writes each signal's number to a pipe as it arrives (``signal.set_wakeup_fd``), and the
watchdog's thread waits on that pipe between its looks.

The pipe is the process's while the watchdog runs: installed with its thread on the main thread, and only where no
wakeup descriptor is set already (an event loop's); :meth:`SignalPipe.close` restores the process as it was and
closes both ends, on the main thread as well (``set_wakeup_fd`` may be called there alone). Until then neither end is
closed: Python's handler would write into whatever file reused the descriptor.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

_ACTED_ON = (signal.SIGTERM, signal.SIGINT)


class SignalPipe:
    """The read and write ends of the wakeup pipe, installed."""

    def __init__(self, read: int, write: int) -> None:
        self._read, self._write = read, write
        self._closed = False

    @classmethod
    def install(cls) -> SignalPipe | None:
        """A pipe Python writes each signal's number to; None off the main thread or where a wakeup descriptor is
        set already."""
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            earlier = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            earlier = -2
        if earlier != -1:
            if earlier >= 0:
                signal.set_wakeup_fd(earlier)
            os.close(read)
            os.close(write)
            return None
        return cls(read, write)

    def received(self, timeout: float) -> int | None:
        """Wait ``timeout`` seconds, or less if a signal arrives: SIGTERM's or SIGINT's number, then (others are
        left to their handlers)."""
        if self._closed:
            time.sleep(timeout)
            return None
        waiting = select.poll()  # not `select.select`: it refuses a descriptor above 1023 (a process with many files)
        waiting.register(self._read, select.POLLIN)
        if not waiting.poll(timeout * 1000):
            return None
        with contextlib.suppress(BlockingIOError):
            for signum in os.read(self._read, 64):
                if signum in _ACTED_ON:
                    return signum
        return None

    def close(self) -> bool:
        """On the main thread: the process's wakeup descriptor as it was before :meth:`install`, and both ends closed;
        False (nothing done) elsewhere."""
        if self._closed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        current = signal.set_wakeup_fd(-1)
        if current not in (self._write, -1):  # someone installed their own since: theirs stays
            signal.set_wakeup_fd(current)
        self._closed = True
        os.close(self._read)
        os.close(self._write)
        return True
