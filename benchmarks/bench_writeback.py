"""How a rank's offload files reach the disk: the ways a written range can be written back, and what reading it
again costs once dropped, on the disk under ``--dir``.

Run from the repository root: ``python -m benchmarks.bench_writeback [--dir DIR] [--gib 2] [--range-mib 32]
[--repeats 3]``. Each way writes ``--gib`` GiB of fresh values in ranges of ``--range-mib`` MiB to a new nameless file
whose space is reserved first (as the offload files are), range after range, with at most 256 MiB of written ranges
under way at once (what a rank lets wait under a memory limit), and the ways are interleaved, ``--repeats`` times:

- **fdatasync**: the range written through a shared mapping, its writeback started (``POSIX_FADV_DONTNEED``) and,
  once more than 256 MiB are under way, the file synced whole (``fdatasync``) and the oldest range dropped: what a
  rank did under a memory limit before the page-cache budget;
- **sync_file_range**: the same, each range's writeback started alone and the oldest range waited for alone
  (:mod:`lightning_zero._offload.sync_range`), then dropped;
- **O_DIRECT**: the range written from an aligned buffer with ``pwrite`` through an ``O_DIRECT`` descriptor, past
  the page cache (DeepSpeed's asynchronous I/O, here synchronous: one range at a time);
- **kept**: written through the mapping and left to the kernel (no memory limit): the time to dirty the pages.

Then the file is read whole through its mapping twice: from the page cache (**kept**) and from the disk after its
pages were dropped (**dropped**): what reading again a range that left the page cache costs.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_zero._files import nameless_mapping
from lightning_zero._offload.sync_range import start_writeback, wait_written

MIB = 2**20
UNDER_WAY = 256 * MIB


def _fill(view: torch.Tensor, value: int) -> None:
    view.fill_(float(value))


def through_mapping(retire: Callable[[int, deque[tuple[int, int]]], None] | None) -> Callable[..., None]:
    """A way that writes each range through the file's mapping and then ``retire``s it (``None``: kept)."""

    def run(directory: Path, size: int, step: int) -> None:
        fd, mapping = nameless_mapping(directory, size)
        try:
            values = torch.frombuffer(mapping, dtype=torch.float32)
            under_way: deque[tuple[int, int]] = deque()
            for index, offset in enumerate(range(0, size, step)):
                _fill(values[offset // 4 : (offset + step) // 4], index)
                mapping.madvise(mmap.MADV_DONTNEED, offset, step)
                if retire is not None:
                    under_way.append((offset, step))
                    retire(fd, under_way)
            while retire is not None and under_way:
                offset, length = under_way.popleft()
                wait_written(fd, offset, length)
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            del values
        finally:
            mapping.close()
            os.close(fd)

    return run


def _by_file(fd: int, under_way: deque[tuple[int, int]]) -> None:
    offset, length = under_way[-1]
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)  # starts the writeback of its dirty pages
    while len(under_way) * length > UNDER_WAY:
        offset, length = under_way.popleft()
        os.fdatasync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _by_range(fd: int, under_way: deque[tuple[int, int]]) -> None:
    offset, length = under_way[-1]
    start_writeback(fd, offset, length)
    while len(under_way) * length > UNDER_WAY:
        offset, length = under_way.popleft()
        wait_written(fd, offset, length)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def direct(directory: Path, size: int, step: int) -> None:
    fd, mapping = nameless_mapping(directory, size)  # reserved as the others; written past its page cache
    mapping.close()
    direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT)
    buffer = mmap.mmap(-1, step)  # page-aligned, as O_DIRECT wants
    values = torch.frombuffer(buffer, dtype=torch.float32)
    try:
        for index, offset in enumerate(range(0, size, step)):
            _fill(values, index)
            os.pwrite(direct_fd, buffer, offset)
        os.fdatasync(direct_fd)
    finally:
        del values
        buffer.close()
        os.close(direct_fd)
        os.close(fd)


WAYS: dict[str, Callable[[Path, int, int], None]] = {
    "fdatasync": through_mapping(_by_file),
    "sync_file_range": through_mapping(_by_range),
    "O_DIRECT": direct,
    "kept": through_mapping(None),
}


def read_twice(directory: Path, size: int) -> tuple[float, float]:
    """Seconds to read ``size`` bytes through a mapping from the page cache, then from the disk."""
    fd, mapping = nameless_mapping(directory, size)
    try:
        values = torch.frombuffer(mapping, dtype=torch.float32)
        values.fill_(1.0)
        mapping.madvise(mmap.MADV_DONTNEED)
        seconds = []
        for dropped in (False, True):
            if dropped:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
            started = time.perf_counter()
            float(values.sum())
            seconds.append(time.perf_counter() - started)
            mapping.madvise(mmap.MADV_DONTNEED)
        del values
        return seconds[0], seconds[1]
    finally:
        mapping.close()
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--range-mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    step = args.range_mib * MIB
    size = int(args.gib * 2**30) // step * step
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way, run in WAYS.items():
            os.sync()
            started = time.perf_counter()
            run(args.dir, size, step)
            seconds[way].append(time.perf_counter() - started)
    print(f"{size / 2**30:.2f} GiB in ranges of {args.range_mib} MiB on {args.dir}, {args.repeats} rounds interleaved")
    print("| way | MB/s (median) | MB/s (min-max) |\n|---|---|---|")
    for way, times in seconds.items():
        rates = sorted(size / t / 1e6 for t in times)
        print(f"| {way} | {statistics.median(rates):.0f} | {rates[0]:.0f}-{rates[-1]:.0f} |")
    cached, from_disk = read_twice(args.dir, size)
    print(f"\nRead through the mapping: {size / cached / 1e6:.0f} MB/s from the page cache, "
          f"{size / from_disk / 1e6:.0f} MB/s from the disk after its pages were dropped")  # fmt: skip


if __name__ == "__main__":
    main()
