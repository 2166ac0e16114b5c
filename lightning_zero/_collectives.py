"""The collective calls of the engine, each labelled for the profiler as ``lightning_zero::<name>``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

# torch 2.13 renamed the flat-tensor collectives; older releases know only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def all_reduce_sum(buffer: torch.Tensor, group: ProcessGroup) -> Work:
    with torch.profiler.record_function("lightning_zero::all_reduce_grads"):
        return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_sum(output: torch.Tensor, buffer: torch.Tensor, group: ProcessGroup) -> Work:
    with torch.profiler.record_function("lightning_zero::reduce_scatter_grads"):
        return _reduce_scatter(output, buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather(output: torch.Tensor, chunk: torch.Tensor, group: ProcessGroup) -> Work:
    with torch.profiler.record_function("lightning_zero::all_gather_params"):
        return _all_gather(output, chunk, group=group, async_op=True)


def broadcast_(tensors: list[torch.Tensor], group: ProcessGroup, src: int = 0) -> None:
    """Broadcast ``tensors`` from group rank ``src`` in place, one flat message per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.profiler.record_function("lightning_zero::broadcast_buffers"):
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype])
            dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
            parts = flat.split([t.numel() for t in same_dtype])
            torch._foreach_copy_(same_dtype, [part.view_as(t) for part, t in zip(parts, same_dtype, strict=True)])
