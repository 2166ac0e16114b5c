"""``fully_shard``'s all-gather and reduce-scatter on CPU process groups, done with this package's collectives
(:mod:`lightning_zero._transport`); where torch keeps its own (NCCL, torch 2.8), a label recorded before each.

On one host they go through shared memory (:mod:`lightning_zero._transport.shared_memory`), where the all-gather output
is a buffer of the shared gather ring when one fits: ``fully_shard`` copies this rank's shard into its row, and the
all-gather is a barrier. Across hosts they are point-to-point exchanges
(:mod:`lightning_zero._transport.collectives`). Both complete before returning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule

from lightning_zero._stage3.seam import CUSTOM_COLLECTIVES, AllGather, ReduceScatter, around_own_collectives
from lightning_zero._transport import activity, labels, quantized, shared_memory, stalls
from lightning_zero._transport import collectives as comm
from lightning_zero._transport.mesh import Split
from lightning_zero._transport.quantized import EXACT, Wire

T = TypeVar("T")
RING_BUFFER_LIMIT = 256 * 2**20  # a unit gathering more goes through the channel's slots


def install(
    fsdp_modules: list[nn.Module],
    group: ProcessGroup,
    largest_unit_bytes: int,
    replicas: ProcessGroup | None = None,
    wire: Wire | None = None,
) -> shared_memory.Channel | None:
    """Give every ``fully_shard``-ed module of a gloo group this package's collectives (where torch lets them be
    replaced), with a gather ring sized for the largest unit when the ranks share a host. With ``replicas`` (hybrid
    sharding: ``group`` is one shard group), each unit's reduced gradient shards are then averaged across the groups.
    ``wire`` says what crosses between hosts quantized (ZeRO++). The last module is the root; each unit's collectives
    are labelled with its path in it (:mod:`.labels`). Returns
    the shared-memory channel the units' collectives go through (or, on a torch without pluggable collectives, meet
    in before each), if they do."""
    wire = wire or EXACT
    if replicas is not None:
        for module in fsdp_modules:
            assert isinstance(module, FSDPModule)
            module.set_all_reduce_hook(AcrossReplicas(replicas, wire.gradients))
    if group.size() == 1:
        return None
    if wire.quantizes and not CUSTOM_COLLECTIVES:  # on gloo: the mode refused other backends
        raise ValueError(
            f"`quantize_weights` and `quantize_gradients` replace `fully_shard`'s collectives, which torch"
            f" {torch.__version__} does not let this package do with offloaded stage 3. HINT: drop them, or keep"
            " stage 3 on the device (no `offload_optimizer`, no `offload_parameters`), or run a newer torch."
        )
    root = fsdp_modules[-1]
    paths = {module: path for path, module in root.named_modules()}
    where = {module: (_class_name(root), paths[module]) for module in fsdp_modules}
    if dist.get_backend(group) != "gloo":
        _record_own_collectives(fsdp_modules, where)
        return None
    if not CUSTOM_COLLECTIVES:
        return _label_own_collectives(fsdp_modules, group, where)
    channel = shared_memory.channel(group)
    # a quantized gather writes every row itself, which a ring buffer shared by the ranks cannot take
    ring = channel if channel is not None and not wire.weights else None
    if ring is not None:
        open_gather_ring(ring, largest_unit_bytes)
    for module in fsdp_modules:
        assert isinstance(module, FSDPModule)
        gather = labels.unit_gather(*where[module])
        module.set_custom_all_gather(HostAllGather(ring, gather, wire.ranks_per_node if wire.weights else None))
        reduce = labels.unit_reduce(*where[module])
        module.set_custom_reduce_scatter(HostReduceScatter(reduce, wire.by_host if wire.gradients else None))
    return channel


def open_gather_ring(channel: shared_memory.Channel, largest_unit_bytes: int) -> None:
    """Collective: ``channel``'s gather ring, sized for the largest unit (up to :data:`RING_BUFFER_LIMIT`); where
    ``/dev/shm`` has no room for it, units are gathered through the channel's slots, and rank 0 says so."""
    ring_bytes = min(_page_multiple(largest_unit_bytes), RING_BUFFER_LIMIT)
    if not channel.open_gather_ring(ring_bytes) and dist.get_rank() == 0:  # said once per run
        warnings.warn(
            f"lightning_zero: /dev/shm has no room for stage 3's gather ring ({shared_memory.RING_SIZE} x"
            f" {ring_bytes / 2**20:.1f} MiB); units are gathered through smaller shared buffers, with two more"
            " copies each. HINT: give /dev/shm more room (`docker run --shm-size=...`).",
            stacklevel=3,
        )


def _label_own_collectives(
    fsdp_modules: list[nn.Module], group: ProcessGroup, where: dict[nn.Module, tuple[str, str]]
) -> shared_memory.Channel | None:
    """A torch whose ``fully_shard`` keeps its own collectives (torch 2.8): they stay gloo's, and the ranks meet,
    labelled, just before each (in the shared-memory channel where they share a host, in gloo's point-to-point
    messages otherwise: :func:`lightning_zero._transport.collectives.meet`), so that ranks that run different units
    fail at once rather than pair one unit's gather with another's, or with Lightning's broadcast
    (:mod:`lightning_zero._transport.labels`)."""
    for module in fsdp_modules:
        # `fully_shard` averages by asking gloo for `ReduceOp.AVG`, which gloo sums instead, silently: have it sum,
        # and `fully_shard` divide the result
        assert isinstance(module, FSDPModule)
        module.set_force_sum_reduction_for_comms(True)
    channel = shared_memory.channel(group)
    meet = channel.meet if channel is not None else partial(comm.meet, group=group)
    _around_own_collectives(fsdp_modules, where, meet)
    return channel


def _record_own_collectives(fsdp_modules: list[nn.Module], where: dict[nn.Module, tuple[str, str]]) -> None:
    """Where ``fully_shard`` keeps its own collectives on NCCL: each unit's gather and reduction is recorded as it
    starts, for the stall watchdog (:mod:`lightning_zero._transport.activity`),
    and one the watchdog released fails with its verdict (:func:`~lightning_zero._transport.stalls.as_verdict`)."""
    _around_own_collectives(fsdp_modules, where, activity.entered)


def _around_own_collectives(
    fsdp_modules: list[nn.Module], where: dict[nn.Module, tuple[str, str]], before: Callable[[int], None]
) -> None:
    """``before`` each unit's label just before each of its own gathers and reductions, and a collective released by
    the stall watchdog failing with its verdict."""
    for module in fsdp_modules:
        assert isinstance(module, FSDPModule)
        gather, reduce = labels.unit_gather(*where[module]), labels.unit_reduce(*where[module])
        around_own_collectives(module, partial(_labelled, before, gather), partial(_labelled, before, reduce))


def _labelled(before: Callable[[int], None], label: int, collective: Callable[[], T]) -> T:
    before(label)
    return stalls.as_verdict(collective)


def _class_name(module: nn.Module) -> str:
    """The class of ``module`` before ``fully_shard`` made it an ``FSDP<class>``."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _page_multiple(size: int) -> int:
    page = 4096
    return max(page, -(-size // page) * page)


class HostAllGather(AllGather):  # type: ignore[misc]
    """All-gather into a gather-ring buffer (``allocate``) where the channel has one free and large enough; with
    ``quantize_across`` (the ranks per node), int8 over a group that spans nodes (the forward's; the backward's of a
    secondary copy stays within a node, exact)."""

    def __init__(self, channel: shared_memory.Channel | None, label: int, quantize_across: int | None = None) -> None:
        self._channel = channel
        self._label = label  # the unit's
        self._quantize_across = quantize_across
        self._spans: dict[ProcessGroup, bool] = {}

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._channel is not None and device.type == "cpu":
            shared = self._channel.gather_buffer(math.prod(size), dtype)
            if shared is not None:
                return shared.view(*size)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup, async_op: bool = False
    ) -> None:
        if self._quantize_across is not None and self._crosses(group, self._quantize_across):
            quantized.all_gather(output_tensor, input_tensor, group, self._label)
        else:
            comm.all_gather(output_tensor, input_tensor, group, self._label).wait()

    def _crosses(self, group: ProcessGroup, ranks_per_node: int) -> bool:
        if group not in self._spans:
            self._spans[group] = quantized.spans_hosts(group, ranks_per_node)
        return self._spans[group]


class HostReduceScatter(ReduceScatter):  # type: ignore[misc]
    """Reduce-scatter (a sum or an average) with this package's collectives; with ``by_host`` (the shard group split
    by host), within each host exactly and then across hosts quantized, with the unit's error feedback."""

    def __init__(self, label: int, by_host: Split | None = None) -> None:
        self._label = label  # the unit's
        self._by_host = by_host
        self._feedback = quantized.ErrorFeedback()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return
        if self._by_host is not None:
            by_host, feedback = self._by_host, self._feedback
            quantized.hierarchical_reduce_scatter(output_tensor, input_tensor, by_host, self._label, feedback).wait()
        else:
            comm.reduce_scatter_sum(output_tensor, input_tensor, group, self._label).wait()
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())


class AcrossReplicas:
    """``fully_shard``'s all-reduce hook under hybrid sharding: a unit's gradient shards, reduced within the shard
    group, averaged across the shard groups (each holds the same rows), through this package's collectives; with
    ``quantize``, quantized both ways (every group ends with the same values)."""

    def __init__(self, replicas: ProcessGroup, quantize: bool = False) -> None:
        self._replicas = replicas
        self._quantized = quantized.AcrossGroups() if quantize else None

    def __call__(self, output: torch.Tensor) -> None:
        if self._quantized is not None:
            self._quantized.all_reduce_sum(output, self._replicas, labels.ALL_REDUCE)
        else:
            comm.all_reduce_sum(output, self._replicas).wait()
        output.div_(self._replicas.size())
