"""One trainable parameter of the module and the shard of it that this rank's optimizer updates."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lightning_zero._engine.layout import ShardSpec


class ShardedParam:
    """A module parameter seen by the optimizer as its shard on the data-parallel mesh.

    ``shard`` is an ``nn.Parameter`` holding a DTensor (``Shard(0)``, or ``Replicate`` for a 0-dim parameter) over
    ``master``. Without a master dtype, ``master`` *is* ``local``, a view of this rank's rows of the module parameter:
    the optimizer's in-place update writes straight into the module, and only the other ranks' rows travel after the
    step. With one (the ZeRO mixed-precision mode: 16-bit module, fp32 optimizer), ``master`` is a copy of those rows
    in that dtype, and exists for this rank's rows only. Per-parameter maths in an optimizer (a trust ratio's norms,
    say) sees the whole parameter through DTensor's reductions. The placement (:mod:`lightning_zero._offload.placement`)
    may put ``master`` on another device than the module (the host), with a buffer there for the reduced gradient.
    """

    def __init__(
        self, param: nn.Parameter, spec: ShardSpec, mesh: DeviceMesh, local: torch.Tensor | None = None
    ) -> None:
        self.param = param
        self.spec = spec
        self.mesh = mesh
        self.rank = mesh.get_local_rank()
        self.placements: tuple[Placement, ...] = (Replicate(),) if spec.replicated else (Shard(0),)
        self._stride = torch.empty(spec.shape, device="meta").stride()  # of the whole parameter, contiguous
        # local_shape(rank): a view of param's own storage, or (stage 3, where the whole parameter exists only while
        # gathered) the rows kept in its unit's storage
        self.local = spec.take(param.detach(), self.rank) if local is None else local
        self.host_mesh: DeviceMesh | None = None
        self.master = self.local
        self.shard = nn.Parameter(self.wrap(self.master), requires_grad=param.requires_grad)
        self.grad_storage: torch.Tensor | None = None  # set by the gradient reducer: where reduced gradients land
        self._grad_view: DTensor | None = None  # a DTensor over ``grad_storage`` when the optimizer can use it as is
        self.master_grad: torch.Tensor | None = None  # beside a master on another device: the step's gradient
        self._master_grad_view: DTensor | None = None
        self._master_grad_streamed = False  # the reducer copies the whole bucket there itself

    def use_master(self, master: torch.Tensor, host_mesh: DeviceMesh | None = None) -> None:
        """Let the optimizer step on ``master``, a copy of ``local`` in another dtype or on the host, instead of the
        module's rows. ``host_mesh``: the same ranks as a CPU mesh, for host tensors of a module on another device
        (a DTensor moves its local tensor to its mesh's device type)."""
        self.host_mesh = host_mesh
        self.master = master
        self.shard = nn.Parameter(self.wrap(master), requires_grad=self.param.requires_grad)

    def use_master_grad(self, master_grad: torch.Tensor, streamed: bool = False) -> None:
        """For a master on another device: reduced gradients land in ``master_grad`` (there, shaped and typed like
        the master), copied at publication or, when ``streamed``, by the reducer with the rest of their bucket."""
        self.master_grad = master_grad
        self._master_grad_view = self.wrap(master_grad)
        self._master_grad_streamed = streamed

    @property
    def has_master(self) -> bool:
        return self.master is not self.local

    def wrap(self, local: torch.Tensor) -> DTensor:
        """A DTensor of this parameter's global shape around ``local``, this rank's part of it, on the host mesh when
        ``local`` is a host tensor of an offloaded device module."""
        mesh = self.host_mesh if self.host_mesh is not None and local.device.type == "cpu" else self.mesh
        return DTensor.from_local(
            local, mesh, self.placements, run_check=False, shape=self.spec.shape, stride=self._stride
        )

    @property
    def grad_to_host(self) -> bool:
        """Whether the optimizer steps on the host for a module elsewhere: its gradients must cross to the host."""
        return self.master.device.type == "cpu" and self.param.device.type != "cpu"

    def set_grad_storage(self, local_grad: torch.Tensor) -> None:
        self.grad_storage = local_grad
        usable = (local_grad.dtype, local_grad.device) == (self.master.dtype, self.master.device)
        self._grad_view = self.wrap(local_grad) if usable else None

    @property
    def grad_copied(self) -> bool:
        """Whether the reduced gradient reaches the optimizer as a copy (another dtype than the master's, on its
        device): :meth:`release_grad_copy` frees it after the step."""
        return self.master_grad is None and self._grad_view is None

    def publish_grad(self, copy: bool) -> torch.Tensor:
        """Hand the reduced gradient to the optimizer, as a view of its storage or, when ``copy`` (the caller will
        unscale it in place) or the master dtype differs, as a copy in the master dtype; for a master on another device,
        into its buffer there, asynchronously (the reducer waits for the copies). Returns its local tensor."""
        assert self.grad_storage is not None
        if self.master_grad is not None:
            if not self._master_grad_streamed:
                self.master_grad.copy_(self.grad_storage, non_blocking=True)
            self.shard.grad = self._master_grad_view
            return self.master_grad
        if self._grad_view is not None and not copy:
            self.shard.grad = self._grad_view
            return self.grad_storage
        local = self.grad_storage.to(self.master.dtype, copy=True)
        self.shard.grad = self.wrap(local)
        return local

    def release_grad_copy(self) -> None:
        """Free a gradient handed over as a copy once the optimizer has used it: with fp32 masters that is 4 bytes
        per shard element which would otherwise live through the next forward."""
        if self.shard.grad is not None and self.shard.grad is not self._grad_view:
            self.shard.grad = None
