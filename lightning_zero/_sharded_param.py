"""One trainable parameter of the module and the shard of it that this rank's optimizer updates."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lightning_zero._layout import ShardSpec


class ShardedParam:
    """A module parameter seen by the optimizer as its shard on the data-parallel mesh.

    ``shard`` is an ``nn.Parameter`` holding a DTensor (``Shard(0)``, or ``Replicate`` for a 0-dim parameter) whose
    local tensor is a view of this rank's rows of the module parameter. The optimizer's in-place update therefore
    writes straight into the module, and only the other ranks' rows travel after the step. Per-parameter maths in an
    optimizer (a trust ratio's norms, say) sees the whole parameter through DTensor's reductions.
    """

    def __init__(self, param: nn.Parameter, spec: ShardSpec, mesh: DeviceMesh) -> None:
        self.param = param
        self.spec = spec
        self.mesh = mesh
        self.rank = mesh.get_local_rank()
        self.placements: tuple[Placement, ...] = (Replicate(),) if spec.replicated else (Shard(0),)
        self.local = spec.take(param.detach(), self.rank)  # view of param's own storage, local_shape(rank)
        self.shard = nn.Parameter(self.wrap(self.local), requires_grad=param.requires_grad)
        self.shard_grad: DTensor | None = None  # set by the gradient reducer: a DTensor over its persistent storage

    def wrap(self, local: torch.Tensor) -> DTensor:
        """A DTensor of this parameter's global shape around ``local``, this rank's part of it."""
        stride = torch.empty(self.spec.shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.spec.shape, stride=stride
        )

    def set_grad_storage(self, local_grad: torch.Tensor) -> None:
        self.shard_grad = self.wrap(local_grad)

    def publish_grad(self) -> None:
        self.shard.grad = self.shard_grad
