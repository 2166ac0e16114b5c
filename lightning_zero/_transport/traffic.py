"""Bytes through the package's collectives, counted by kind, so a step's communication volume is measured rather
than derived: ``all_reduce`` counts its buffer, ``reduce_scatter`` its whole (``world_size``-chunk) input,
``all_gather`` its whole output, ``broadcast`` what is broadcast. In the ZeRO paper's terms a reduce-scatter or an
all-gather of Psi elements moves Psi, an all-reduce 2 Psi (a ring sends (N-1)/N of that over each rank's link)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Traffic:
    """Bytes and calls per collective kind since the last ``reset``."""

    bytes: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


TRAFFIC = Traffic()  # this process's, for every group
