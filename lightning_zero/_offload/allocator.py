"""The C allocator under ``offload_parameters="disk"``: freed tensors go back to the system at once.

glibc's ``malloc`` serves a request of at least its *mmap threshold* with a mapping of its own, unmapped when freed,
and anything smaller from its heaps (one arena per thread that allocates), whose freed space it keeps for later
requests. The threshold starts at 128 KiB, but each such free raises it to the freed block's size, up to 32 MiB: once
a unit's tensors have come and gone, blocks of their size come from the heaps. Stage 3 gathers, reduces and steps
one unit after another, each a new set of tensors of up to tens of MiB made on several threads (the forward's, the
backward's, the collectives'), and the space the heaps keep then grows with the number of units: 11 bytes per
parameter a rank for the demo Transformer at width 512, 2.6 at width 2048 (benchmarks/bench_infinity.py).

:func:`return_large_blocks` fixes the threshold at glibc's starting value (``mallopt``; fixing it also stops its
rise), so every tensor of 128 KiB or more is unmapped as it is freed, and the heaps are trimmed from 128 KiB of free
space at their top. It is a setting of the process's allocator, not undone at teardown: glibc cannot turn the rise
back on. Elsewhere than glibc it does nothing.

It must come before the module is built, not only before its shards get their values: building it under stage 3's
init context allocates each parameter's ``torch.empty`` storage (never written) and frees it as the parameter becomes
lazy, so with the threshold risen the heap grows by the model's size in untouched pages; fixing the threshold then
leaves that space in the heap, where malloc still serves large requests from free space before it maps any, and
setting up and stepping touch more of it with each unit (a 192-layer stack of ``Linear(1024)`` on 2 ranks: a heap
of 905 MiB, 745 of them free, after building; up to 719 MiB of anonymous memory after set-up and 840 after the first
step, against 338 and 364 with the threshold fixed first).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
THRESHOLD = 128 * 1024  # bytes: glibc's own starting mmap threshold


def return_large_blocks() -> bool:
    """Fix glibc's mmap and trim thresholds at :data:`THRESHOLD`; ``False`` where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD))
