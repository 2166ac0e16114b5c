"""A progress bar for long work, drawn only for a person watching a terminal.

Work that runs for minutes (reading a multi-GB checkpoint, say) draws tqdm's bar on stderr when stderr is a terminal.
In a log file, a pipe or a batch job's output it draws nothing, so logs stay free of carriage returns; ``shown=False``
(the command line's ``--quiet``) silences it on a terminal too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def progress(total_bytes: int, description: str, *, shown: bool = True) -> Iterator[Callable[[int], object]]:
    """Yield ``advance(nbytes)``, to call as each piece of ``total_bytes`` is done; the bar shows the bytes done, the
    rate and the time left, and is drawn only when ``shown`` and stderr is a terminal."""
    drawn = shown and sys.stderr.isatty()
    bar = tqdm(
        total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
        disable=not drawn,
    )  # fmt: skip
    with bar:
        yield bar.update
