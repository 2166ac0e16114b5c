"""Collectives that send quantized values between hosts (ZeRO++): the rest of the package's collectives
(:mod:`.collectives`) carry packed bytes (:mod:`.quantize`) and each rank dequantizes what it receives.

- :func:`all_gather`: stage 3's gather of a unit's parameters across hosts. Every rank, this one included, uses the
  dequantized rows, so the ranks compute with the same weights; the shards themselves (the masters) stay exact.
- :func:`reduce_scatter_sum`: each rank sends its chunk for every peer quantized (an all-to-all, in flight until its
  wait) and sums what it receives in fp32, in rank order, its own chunk exact.
- :func:`hierarchical_reduce_scatter`: a reduce-scatter over ranks of several hosts, reduced first within each host at
  full precision and then across hosts quantized, so only ``1 / ranks_per_host`` of the buffer crosses, quantized.
- :class:`AcrossGroups`: the all-reduce of hybrid sharding's shards across the shard groups, a quantized
  reduce-scatter then a quantized all-gather; every rank ends with the same values.

Each reduction takes an :class:`ErrorFeedback`: what quantizing a call site's values left out is added to what that
call site sends next, so that the errors do not accumulate over steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_zero._transport import collectives as comm
from lightning_zero._transport.mesh import Split
from lightning_zero._transport.quantize import INT8, Format, dequantize, quantize

WEIGHTS = INT8
GRADIENTS = INT8


@dataclass(frozen=True)
class Wire:
    """What the collectives of stages 2 and 3 send between nodes quantized (ZeRO++), where the shard group spans nodes
    (or, for gradients, where hybrid sharding's replicas do)."""

    ranks_per_node: int = 1
    weights: bool = False  # the gathers of parameters over the whole shard group
    gradients: bool = False  # the reductions: by node (``by_host``), then across nodes; replicas' all-reduce
    by_host: Split | None = None  # the shard group split by node, where gradients are quantized and it spans nodes

    @property
    def quantizes(self) -> bool:
        return self.weights or self.gradients


EXACT = Wire()  # nothing quantized


class ErrorFeedback:
    """One call site's quantization error, carried into its next exchange."""

    def __init__(self) -> None:
        self._residual: torch.Tensor | None = None

    def quantize(self, rows: torch.Tensor, form: Format) -> torch.Tensor:
        """``rows`` (2-D, changed in place) with the last error added, packed; the new error kept."""
        if self._residual is not None and self._residual.shape == rows.shape:
            rows.add_(self._residual)
        packed = quantize(rows, form)
        residual = dequantize(packed, form, torch.empty_like(rows, dtype=torch.float32))
        torch.sub(rows, residual, out=residual)
        self._residual = residual
        return packed


def all_gather(output: torch.Tensor, chunk: torch.Tensor, group: ProcessGroup, label: int) -> None:
    """``output`` (``size`` rows) gets every rank's ``chunk``, sent as :data:`WEIGHTS`."""
    packed = quantize(chunk.reshape(1, -1), WEIGHTS)
    gathered = torch.empty(group.size(), packed.shape[1], dtype=torch.uint8, device=chunk.device)
    comm.all_gather(gathered, packed[0], group, label).wait()
    dequantize(gathered, WEIGHTS, output.view(group.size(), -1))


def reduce_scatter_sum(
    output: torch.Tensor,
    buffer: torch.Tensor,
    group: ProcessGroup,
    label: int,
    feedback: ErrorFeedback,
    exact_tail: int = 0,
) -> comm.Exchange:
    """In flight: ``output`` gets the sum over ranks of this rank's chunk of ``buffer`` (``size`` chunks, which it may
    change), the peers' chunks sent as :data:`GRADIENTS` but for the last ``exact_tail`` elements of each (counts that
    must arrive exact); summed in fp32 in rank order at the wait. Only the rows sent are quantized."""
    size, me = group.size(), group.rank()
    rows = buffer.view(size, -1)
    width = rows.shape[1] - exact_tail
    others = [rank for rank in range(size) if rank != me]
    sent_rows = rows[others, :width]  # a copy: the rows this rank sends
    packed = feedback.quantize(sent_rows, GRADIENTS)
    sent = torch.empty(size, packed.shape[1] + exact_tail * rows.dtype.itemsize, dtype=torch.uint8, device=rows.device)
    sent[others, : packed.shape[1]] = packed
    if exact_tail:
        sent[:, packed.shape[1] :] = rows[:, width:].contiguous().view(torch.uint8)
    received = torch.empty_like(sent)
    mine = rows[me].clone()

    def finish() -> None:
        parts = torch.empty(size, rows.shape[1], dtype=torch.float32, device=rows.device)
        # (indexed by a list of rows, a tensor is a copy: filled, then put in place)
        parts[others, :width] = dequantize(received[others, : packed.shape[1]], GRADIENTS, torch.empty_like(sent_rows))
        if exact_tail:
            parts[others, width:] = received[others, packed.shape[1] :].contiguous().view(rows.dtype).float()
        parts[me] = mine
        summed = parts[0]
        for rank in range(1, size):
            summed.add_(parts[rank])
        output.copy_(summed)

    return comm.exchange_rows(received, sent, group, label, finish)


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    buffer: torch.Tensor,
    split: Split,
    label: int,
    feedback: ErrorFeedback,
    exact_tail: int = 0,
) -> comm.Exchange:
    """In flight: ``output`` gets the sum over the group's ranks of this rank's chunk of ``buffer`` (one chunk per
    rank, host by host): reduced within the host exactly (done on return), then across the hosts quantized (but
    ``exact_tail``)."""
    hosts, per_host = split.across.size(), split.inner.size()
    # the chunks of this rank's counterparts on every host, next to each other: one row per place in a host
    arranged = buffer.view(hosts, per_host, -1).transpose(0, 1).contiguous()
    within = torch.empty(arranged.shape[1:], dtype=buffer.dtype, device=buffer.device)
    comm.reduce_scatter_sum(within.view(-1), arranged.view(-1), split.inner, label).wait()
    del arranged
    return reduce_scatter_sum(output, within.view(-1), split.across, label, feedback, exact_tail)


class AcrossGroups:
    """Hybrid sharding's all-reduce of a shard across the shard groups, quantized both ways (but the last
    ``exact_tail`` elements of each piece); every group ends with the same values."""

    def __init__(self) -> None:
        self._scatter = ErrorFeedback()
        self._gather = ErrorFeedback()

    def all_reduce_sum(
        self, buffer: torch.Tensor, group: ProcessGroup, label: int, exact_tail: int = 0
    ) -> comm.Exchange:
        """``buffer`` summed over ``group``, done on return (a finished exchange, for a chain of them)."""
        if exact_tail:  # counts, summed exactly on their own
            tail = buffer.view(-1)[buffer.numel() - exact_tail :]
            summed = tail.clone()
            comm.all_reduce_sum(summed, group).wait()
            self.all_reduce_sum(buffer.view(-1)[: buffer.numel() - exact_tail], group, label)
            tail.copy_(summed)
            return comm.Exchange([], group)
        size, numel = group.size(), buffer.numel()
        padded = torch.nn.functional.pad(buffer.reshape(-1).float(), (0, -numel % size))
        mine = torch.empty(padded.numel() // size, dtype=torch.float32, device=buffer.device)
        reduce_scatter_sum(mine, padded, group, label, self._scatter).wait()
        packed = self._gather.quantize(mine.view(1, -1), GRADIENTS)
        gathered = torch.empty(size, packed.shape[1], dtype=torch.uint8, device=buffer.device)
        comm.all_gather(gathered, packed[0], group, label).wait()
        dequantize(gathered, GRADIENTS, padded.view(size, -1))
        buffer.view(-1).copy_(padded[:numel])
        return comm.Exchange([], group)


def spans_hosts(group: ProcessGroup, ranks_per_node: int) -> bool:
    """Whether ``group``'s ranks sit on more than one host (nodes of ``ranks_per_node`` consecutive ranks)."""
    return len({rank // ranks_per_node for rank in dist.get_process_group_ranks(group)}) > 1
