"""Bytes through the package's collectives, counted by kind, so a step's communication volume is measured rather
than derived: ``all_reduce`` counts its buffer, ``reduce_scatter`` its whole (``world_size``-chunk) input,
``all_gather`` its whole output, ``broadcast`` what is broadcast. In the ZeRO paper's terms a reduce-scatter or an
all-gather of Psi elements moves Psi, an all-reduce 2 Psi (a ring sends (N-1)/N of that over each rank's link).

Also counted, where the ranks per node are known: the bytes this rank sends to ranks on other nodes, as a direct
exchange sends them (in a reduce-scatter or all-gather of B bytes over n ranks a rank sends B/n to each peer, in an
all-reduce twice that), which is what hybrid sharding keeps off the links between nodes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass
class Traffic:
    """Bytes per collective kind since the last ``reset``."""

    bytes: Counter[str] = field(default_factory=Counter)
    across_nodes: Counter[str] = field(default_factory=Counter)  # sent to ranks on other nodes; kinds that sent any
    ranks_per_node: int = 0  # set when a run starts; 0: unknown, nothing counted as crossing
    # (group, ranks per node) -> (group size, peers on other nodes)
    _elsewhere: dict[tuple[ProcessGroup, int], tuple[int, int]] = field(default_factory=dict)

    def record(self, kind: str, nbytes: int, group: ProcessGroup) -> None:
        self.bytes[kind] += nbytes
        if self.ranks_per_node and kind != "broadcast":
            size, elsewhere = self._placement(group)
            if elsewhere:
                self.across_nodes[kind] += nbytes // size * (2 if kind == "all_reduce" else 1) * elsewhere

    def reset(self) -> None:
        self.bytes.clear()
        self.across_nodes.clear()

    def forget_groups(self) -> None:
        """Drop the placements, which hold their groups (a destroyed group lives on while anything refers to it)."""
        self._elsewhere.clear()

    def _placement(self, group: ProcessGroup) -> tuple[int, int]:
        key = (group, self.ranks_per_node)
        if key not in self._elsewhere:
            node = dist.get_rank() // self.ranks_per_node
            members = dist.get_process_group_ranks(group)
            self._elsewhere[key] = (len(members), sum(r // self.ranks_per_node != node for r in members))
        return self._elsewhere[key]


TRAFFIC = Traffic()  # this process's, for every group
