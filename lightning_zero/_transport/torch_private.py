"""The private parts of torch this package relies on, in one place: each import says what it is for and what happens
when a torch release moves it.

- ``fully_shard``'s pluggable collectives (:class:`AllGather`, :class:`ReduceScatter`), which
  :mod:`.fsdp_comms` implements on CPU process groups; on a torch without them ``fully_shard`` keeps its own
  collectives (:data:`CUSTOM_COLLECTIVES` is false) and training still runs, only slower on gloo.
- ``_sync_module_states``, the broadcast of rank 0's parameters and buffers that DDP and FSDP start from.
"""

from __future__ import annotations

from torch.distributed.utils import _sync_module_states as sync_module_states

try:  # the interface of `fully_shard`'s pluggable collectives (recent torch)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    CUSTOM_COLLECTIVES = True
except ImportError:  # older torch: `fully_shard` keeps its own collectives
    AllGather = ReduceScatter = object  # type: ignore[assignment, misc]
    CUSTOM_COLLECTIVES = False

__all__ = ["CUSTOM_COLLECTIVES", "AllGather", "ReduceScatter", "sync_module_states"]
