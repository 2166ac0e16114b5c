"""Gradient reduction during backward: the part of a stage that decides what happens to gradients.

Each trainable parameter gets a post-accumulate-grad hook. When every parameter of a bucket has its gradient, the
bucket's collective is launched asynchronously (buckets always launch in the same order on every rank, so ranks
whose control flow skipped a parameter still agree); the rest of backward runs while it is in flight. A callback
queued on the autograd engine finishes the job when backward ends: it launches the buckets still waiting on
parameters that got no gradient, waits for all of them, and hands each shard its gradient.

Stage 1 (:class:`AllReduceReducer`) keeps full, averaged gradients in ``param.grad`` as DDP does; stage 2
(:class:`ReduceScatterReducer`) keeps only this rank's shard of them and frees each full gradient once staged.

No value is read back from a gradient buffer while every parameter got a gradient on this rank: the presence flags
(see :mod:`.layout`) then say "present" everywhere, whatever the other ranks had. Only where this rank had none for
some parameter are the flags read, once per backward for all such buckets together: on a GPU that read waits for the
collectives, as DDP's ``find_unused_parameters=True`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from enum import Enum, auto

import torch
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from lightning_zero._config import Stage
from lightning_zero._engine.layout import NaturalLayout, RankMajorLayout, ShardSpec
from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.pool import BufferPool
from lightning_zero._engine.sharded_param import ShardedParam
from lightning_zero._grouping import group_by
from lightning_zero._offload.host import host_copies, pinned_views
from lightning_zero._transport import collectives as comm
from lightning_zero._transport import labels, quantized
from lightning_zero._transport.mesh import DataParallelMesh
from lightning_zero._transport.quantized import EXACT, Wire


class ReduceMode(Enum):
    """Whether the next backward passes reduce across ranks."""

    SYNC = auto()  # reduce as buckets fill; gradients are final when backward returns
    LOCAL = auto()  # accumulate on this rank only (micro-batches before the last of an accumulation window)


class GradHome(Enum):
    """Where a stage leaves the reduced gradients that clipping and the optimizer read."""

    MODULE = auto()  # full, averaged, in ``param.grad``; shards' gradients are views of their rows
    SHARD = auto()  # only this rank's shard, in ``shard.grad``; ``param.grad`` stays ``None``


class Staging(Enum):
    """When a bucket's gradients are copied into its collective's input."""

    EACH_GRADIENT = auto()  # one by one, from each parameter's post-accumulate-grad hook
    WHOLE_BUCKET = auto()  # together, when told every gradient of the bucket is accumulated (stage 3: a unit's)


class BucketState(Enum):
    """Where a bucket is within one backward pass."""

    IDLE = auto()  # no gradient staged yet
    FILLING = auto()  # some gradients staged, waiting for the rest
    REDUCING = auto()  # collective in flight
    DONE = auto()  # collective finished, gradients not yet handed to the shards


class Bucket:
    """Parameters reduced together, and the state of their reduction in the current backward pass."""

    def __init__(self, position: int, params: list[ShardedParam], dtype: torch.dtype | None, staging: Staging) -> None:
        self.position = position  # launch order, the same on every rank
        self.staging = staging
        self.label = labels.REDUCE_SCATTER  # what its collective is for (stage 3: its unit's reduction)
        self.params = params
        self.dtype = dtype or params[0].param.dtype  # of the collective: the parameters' or the reduce dtype
        self.device = params[0].param.device
        self.state = BucketState.IDLE
        self.staged = [False] * len(params)
        self.num_staged = 0
        self.missing: list[int] = []  # parameters with no gradient on this rank: their flags say so
        self.work: comm.Pending | None = None
        self.buffer: torch.Tensor | None = None  # the collective's input while the bucket is filling or reducing
        self.output: torch.Tensor | None = None  # where the reduced values land
        # Set by the policy's ``_build``:
        self.layout: NaturalLayout | RankMajorLayout | None = None
        self.regions: list[torch.Tensor] = []  # stage 1: each parameter's full gradient inside ``buffer``
        self.shard_grads: torch.Tensor | None = None  # stage 2, 1D (chunk_numel): this rank's gradient shards
        # stage 2: where each gradient goes in ``buffer`` while it has one (kept by the pool with the buffer)
        self.slots: list[torch.Tensor | list[torch.Tensor]] = []
        self.host_mirror: torch.Tensor | None = None  # stage 2 offloaded: ``shard_grads`` on the host, pinned
        self.streamed = False  # ``host_mirror`` is being filled on the copy stream in this backward

    @property
    def complete(self) -> bool:
        return self.num_staged == len(self.params)

    @property
    def absent(self) -> bool:
        """Some parameter had no gradient on this rank: the flags must be read to know whether another rank had one."""
        return bool(self.missing)

    def reset(self) -> None:
        self.state = BucketState.IDLE
        self.staged = [False] * len(self.params)
        self.num_staged = 0
        self.missing = []
        self.work = None
        self.streamed = False


class GradReady:
    """A parameter's post-accumulate-grad hook: hands its gradient to the reducer, held weakly. torch's garbage
    collector does not see the references of these hooks, so a reducer they held would make a cycle with its
    parameters that is never collected, keeping buckets, sharded tensors, their mesh and its process groups (with
    gloo's threads) alive to the interpreter's end when the engine is dropped without being detached (a failed load)."""

    __slots__ = ("_index", "_position", "_reducer")

    def __init__(self, reducer: GradientReducer, position: int, index: int) -> None:
        self._reducer = weakref.ref(reducer)
        self._position = position  # the bucket's: the hook holds no bucket, which holds the parameters
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer._on_grad_ready(reducer.buckets[self._position], self._index, param)


class GradientReducer:
    """Reduces gradients across ranks in buckets, overlapping communication with the rest of backward."""

    #: whether ``ReduceMode.LOCAL`` skips reduction; a policy that must free full gradients reduces regardless
    honours_local_accumulation: bool = True
    grad_home: GradHome = GradHome.MODULE

    def __init__(
        self,
        buckets: list[list[ShardedParam]],
        mesh: DataParallelMesh,
        pool: BufferPool,
        reduce_dtype: torch.dtype | None = None,
        scaler: LossScaler | None = None,
        whole: Collection[int] = (),
        wire: Wire = EXACT,
    ) -> None:
        """``whole``: the positions of the buckets staged whole (:attr:`Staging.WHOLE_BUCKET`, see
        :meth:`accumulated`); the others are staged gradient by gradient. ``wire``: what crosses between nodes
        quantized (ZeRO++)."""
        self.buckets = [
            Bucket(p, params, reduce_dtype, Staging.WHOLE_BUCKET if p in whole else Staging.EACH_GRADIENT)
            for p, params in enumerate(buckets)
        ]
        self.scaler = scaler
        # Gradients handed to the optimizer as copies (another dtype, or unscaled) no longer alias ``param.grad``.
        copies = scaler is not None or any(s.has_master for b in buckets for s in b)
        self.grad_home = GradHome.SHARD if copies else type(self).grad_home
        # Offloaded from a CUDA device: gradients are copied to host buffers asynchronously.
        to_host = [s for b in buckets for s in b if s.grad_to_host]
        self._host_copies_on = to_host[0].param.device if to_host else None
        self._copy_stream = torch.cuda.Stream(self._host_copies_on) if to_host else None
        self._published: list[torch.Tensor] = []  # local gradients handed to the optimizer in this backward
        self.group = mesh.shard_group  # shards are split over these ranks
        self.replicas = mesh.replicate  # hybrid sharding: reduced shards are then summed across the groups
        self.wire = wire
        # the buckets whose gradients cross nodes quantized: not one holding a replicated parameter, whose copy in
        # every rank's chunk must sum to the same value everywhere (each chunk is quantized on its own)
        self._quantized = {
            p for p, params in enumerate(buckets) if wire.gradients and not any(s.spec.replicated for s in params)
        }
        self._feedback: dict[int, quantized.ErrorFeedback] = {}  # per bucket: its quantized reduction's error
        self._replicated: dict[int, quantized.AcrossGroups] = {}  # per bucket: its quantized all-reduce across groups
        self.world_size = self.group.size()
        self.rank = self.group.rank()
        self.average_over = mesh.world_size  # every data-parallel rank contributes a gradient
        self.pool = pool
        self.mode = ReduceMode.SYNC
        self._in_backward = False
        self._next_launch = 0  # index of the first bucket not yet launched in this backward
        self._handles: list[RemovableHandle] = []
        for bucket in self.buckets:
            self._build(bucket)
            if bucket.staging is Staging.EACH_GRADIENT:
                for index, sharded in enumerate(bucket.params):
                    hook = GradReady(self, bucket.position, index)
                    self._handles.append(sharded.param.register_post_accumulate_grad_hook(hook))
        if to_host:
            self._give_host_grads([b for b in self.buckets if any(s.grad_to_host for s in b.params)])

    def kept_buffers(self) -> list[torch.Tensor]:
        """The gradient storage the buckets keep between steps: stage 2's gradient shards, stage 1's full buffers."""
        kept = [b.shard_grads if b.shard_grads is not None else b.buffer for b in self.buckets]
        return [t for t in kept if t is not None]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- the policy: what a stage does with a bucket --------------------------------------------------------------

    def _build(self, bucket: Bucket) -> None:
        """Allocate the bucket's persistent storage and point each shard's gradient at it."""
        raise NotImplementedError

    def _stage(self, bucket: Bucket, index: int, sharded: ShardedParam) -> None:
        """Copy ``sharded.param.grad`` into the bucket's input and mark it present."""
        raise NotImplementedError

    def _stage_absent(self, bucket: Bucket, index: int) -> None:
        """Fill the slot of a parameter that produced no gradient on this rank with zeros (its flag is written with
        the others' at launch, from ``bucket.missing``)."""
        raise NotImplementedError

    def _stage_together(self, bucket: Bucket, indices: list[int]) -> None:
        """Copy the gradients of the parameters at ``indices`` into the bucket's input (the first of this backward)."""
        for index in indices:
            self._stage(bucket, index, bucket.params[index])

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's asynchronous collective."""
        raise NotImplementedError

    def _flags(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's presence flags, summed over ranks, once its collective is done."""
        raise NotImplementedError

    def _publish(self, bucket: Bucket, present: list[bool]) -> None:
        """After the collective: give each parameter ``present`` on some rank its reduced gradient."""
        raise NotImplementedError

    # --- the mechanism --------------------------------------------------------------------------------------------

    def _on_grad_ready(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        """Runs once per parameter and backward pass (twice for a tied one): kept to what must happen here."""
        if self.mode is ReduceMode.LOCAL and self.honours_local_accumulation:
            return
        state = bucket.state
        if state is BucketState.REDUCING or state is BucketState.DONE:
            raise RuntimeError(
                f"A parameter of shape {tuple(param.shape)} received a second gradient after its bucket was reduced"
                " in the same backward pass. HINT: use non-reentrant activation checkpointing"
                " (`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`)."
            )
        if not self._in_backward:
            self.backward_started()
        self._stage(bucket, index, bucket.params[index])
        bucket.state = BucketState.FILLING
        if not bucket.staged[index]:
            bucket.staged[index] = True
            bucket.num_staged += 1
            if bucket.num_staged == len(bucket.params) and bucket.position == self._next_launch:
                self._launch_ready_buckets()

    def accumulated(self, position: int, indices: Sequence[int] | None = None) -> None:
        """Every gradient of the parameters at ``indices`` of the bucket at ``position`` (staged whole; all of its
        parameters by default) is accumulated for this backward: they are staged together, a parameter without one
        as absent, and the bucket launches in its turn once all of its parameters are staged."""
        bucket = self.buckets[position]
        if self.mode is ReduceMode.LOCAL and self.honours_local_accumulation:
            return
        self.backward_started()
        fresh = [i for i in (range(len(bucket.params)) if indices is None else indices) if not bucket.staged[i]]
        present: list[int] = []
        absent: list[int] = []
        for i in fresh:
            (absent if bucket.params[i].param.grad is None else present).append(i)
        self._stage_together(bucket, present)
        for index in absent:
            self._stage_absent(bucket, index)
            bucket.missing.append(index)
        for index in fresh:
            bucket.staged[index] = True
        bucket.num_staged += len(fresh)
        bucket.state = BucketState.FILLING
        self._launch_ready_buckets()

    def backward_started(self) -> None:
        """A backward is under way (its first gradient, or, for buckets staged whole, its first unit): the reduction
        is finished at its end, whatever is staged by then."""
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._finalize)

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next_launch]
        self._launch(bucket)
        bucket.state = BucketState.REDUCING
        self._next_launch += 1

    def _finalize(self) -> None:
        """End of backward: reduce what is left, wait for every bucket, publish the gradients."""
        with torch.profiler.record_function("lightning_zero::finalize_grads"):
            while self._next_launch < len(self.buckets):
                bucket = self.buckets[self._next_launch]
                for index, sharded in enumerate(bucket.params):
                    if not bucket.staged[index]:
                        if sharded.param.grad is not None:
                            self._stage(bucket, index, sharded)
                        else:
                            self._stage_absent(bucket, index)
                            bucket.missing.append(index)
                self._launch_next()
            for bucket in self.buckets:
                self._wait(bucket)
            for bucket, present in zip(self.buckets, self._presence(), strict=True):
                self._publish(bucket, present)
                bucket.reset()
            if self._copy_stream is not None:  # the host reads them next (unscale, clipping, the step)
                torch.cuda.current_stream(self._host_copies_on).synchronize()
                self._copy_stream.synchronize()
            if self.scaler is not None:
                self.scaler.unscale_(self._published)
        self._published = []
        self._next_launch = 0
        self._in_backward = False

    def abandon(self) -> None:
        """After an exception aborted a backward: its staged gradients and collectives are dropped, not waited for
        (a peer may have failed). A collective in flight keeps its input, which goes back to no pool."""
        for bucket in self.buckets:
            pooled = bucket.buffer is not None and bucket.shard_grads is not None  # stage 2's staging input
            if pooled and bucket.state is not BucketState.REDUCING:
                self.pool.release(bucket.buffer)
            if bucket.shard_grads is not None:
                bucket.buffer = None
            bucket.output = None
            bucket.reset()
        self._published = []
        self._next_launch = 0
        self._in_backward = False
        for bucket in self.buckets:
            bucket.slots = []  # views of a pooled buffer a failed step may not have given back

    def _presence(self) -> list[list[bool]]:
        """Per bucket, whether each parameter had a gradient on some rank: known without a read where it had one
        here; the flags of the other buckets are read together, in one copy to the host."""
        unknown = [bucket for bucket in self.buckets if bucket.absent]
        read = torch.cat([self._flags(bucket) for bucket in unknown]).tolist() if unknown else []
        present = []
        for bucket in self.buckets:
            if bucket.absent:
                flags, read = read[: len(bucket.params)], read[len(bucket.params) :]
                present.append([flag > 0 for flag in flags])
            else:
                present.append([True] * len(bucket.params))
        return present

    def _wait(self, bucket: Bucket) -> None:
        if bucket.state is BucketState.REDUCING:
            assert bucket.work is not None
            bucket.work.wait()
            bucket.state = BucketState.DONE
            self._release_input(bucket)

    def _release_input(self, bucket: Bucket) -> None:
        """Called once a bucket's collective no longer reads its input."""

    def _give_host_grads(self, buckets: list[Bucket]) -> None:
        """Offloaded: a pinned host buffer per parameter, filled when its gradient is published."""
        to_host = [s for bucket in buckets for s in bucket.params if s.grad_to_host]
        for sharded, host_grad in zip(to_host, host_copies([s.master for s in to_host], None, True), strict=True):
            sharded.use_master_grad(host_grad)

    def _copy_to_host(self, bucket: Bucket) -> None:
        """Stage 2 offloaded: the whole bucket's gradient shards to its host mirror in one copy, on a side stream so
        that it overlaps the rest of backward; queued after the collective that produced them."""
        assert self._copy_stream is not None and bucket.host_mirror is not None
        self._copy_stream.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.cuda.stream(self._copy_stream):
            bucket.host_mirror.copy_(bucket.shard_grads, non_blocking=True)
        bucket.streamed = True

    def _hand_over(self, sharded: ShardedParam) -> None:
        self._published.append(sharded.publish_grad(copy=self.scaler is not None))


class AllReduceReducer(GradientReducer):
    """Stage 1: full gradients, averaged over ranks, kept in ``param.grad`` (a view of a persistent bucket)."""

    def _build(self, bucket: Bucket) -> None:
        bucket.layout = NaturalLayout([s.param.shape for s in bucket.params])
        numel = bucket.layout.numel
        if self.replicas is not None:  # hybrid sharding reduces it in chunks, one per rank of the shard group
            numel = ShardSpec(torch.Size((numel,)), self.world_size).padded_rows
        bucket.buffer = torch.zeros(numel, dtype=bucket.dtype, device=bucket.device)
        bucket.output = bucket.buffer
        bucket.regions = [bucket.layout.region(bucket.buffer, i) for i in range(len(bucket.params))]
        for sharded, region in zip(bucket.params, bucket.regions, strict=True):
            sharded.set_grad_storage(sharded.spec.take(region, self.rank))

    def _stage(self, bucket: Bucket, index: int, sharded: ShardedParam) -> None:
        region = bucket.regions[index]
        grad = sharded.param.grad
        if grad.data_ptr() != region.data_ptr():
            region.copy_(grad)
            sharded.param.grad = region

    def _stage_absent(self, bucket: Bucket, index: int) -> None:
        bucket.regions[index].zero_()

    def _launch(self, bucket: Bucket) -> None:
        flags = bucket.layout.flags(bucket.buffer)
        flags.fill_(1)
        for index in bucket.missing:
            flags[index] = 0
        bucket.buffer.div_(self.average_over)
        if self.replicas is None:
            bucket.work = comm.all_reduce_sum(bucket.buffer, self.group)
        else:
            bucket.work = comm.all_reduce_hierarchical(bucket.buffer, self.group, self.replicas)

    def _flags(self, bucket: Bucket) -> torch.Tensor:
        return bucket.layout.flags(bucket.buffer)

    def _publish(self, bucket: Bucket, present: list[bool]) -> None:
        for sharded, region, flag in zip(bucket.params, bucket.regions, present, strict=True):
            if flag:
                if sharded.param.grad is not region:
                    sharded.param.grad = region
                self._hand_over(sharded)
            else:
                sharded.param.grad = None
                sharded.shard.grad = None


class ReduceScatterReducer(GradientReducer):
    """Stage 2: each rank keeps only its shard of the averaged gradients; full gradients are freed once staged."""

    honours_local_accumulation = False  # accumulating full gradients locally would undo the memory saving
    grad_home = GradHome.SHARD

    def _build(self, bucket: Bucket) -> None:
        bucket.layout = RankMajorLayout([s.spec for s in bucket.params], self.world_size)
        # accumulated across backward passes until the optimizer zeroes the shards' gradients
        bucket.shard_grads = torch.zeros(bucket.layout.chunk_numel, dtype=bucket.dtype, device=bucket.device)
        for index, sharded in enumerate(bucket.params):
            sharded.set_grad_storage(bucket.layout.region(bucket.shard_grads, index, self.rank))

    def _input_chunks(self, bucket: Bucket) -> torch.Tensor:
        if bucket.buffer is None:
            self._take_input(bucket)
        return bucket.layout.chunks(bucket.buffer)

    def _take_input(self, bucket: Bucket) -> None:
        """The bucket's input for this backward, from the pool, and its slots in it. Quantized, its padding is zero:
        what a pooled buffer held before would take part in its blocks' scales."""
        bucket.buffer = self.pool.acquire(bucket.layout.numel, bucket.dtype, bucket.device)
        if self._quantizes(bucket):
            bucket.buffer.zero_()
        bucket.slots = self.pool.derived(bucket.buffer, bucket, self._make_slots(bucket))

    def _make_slots(self, bucket: Bucket) -> Callable[[torch.Tensor], list[torch.Tensor | list[torch.Tensor]]]:
        """Where each parameter's gradient goes in the bucket's input: a ``(world_size, rows x row)`` view across the
        chunks where its rows split evenly (one copy), else one region per rank."""
        layout = bucket.layout

        def make(buffer: torch.Tensor) -> list[torch.Tensor | list[torch.Tensor]]:
            chunks = layout.chunks(buffer)
            return [
                chunks[:, start : start + spec.padded_numel]
                if spec.replicated or spec.shape[0] % self.world_size == 0
                else [layout.region(chunks[r], index, r) for r in range(self.world_size)]
                for index, (start, spec) in enumerate(zip(layout.offsets, layout.specs, strict=True))
            ]

        return make

    def _slots(self, bucket: Bucket) -> list[torch.Tensor | list[torch.Tensor]]:
        if bucket.buffer is None:
            self._take_input(bucket)
        return bucket.slots

    def _stage(self, bucket: Bucket, index: int, sharded: ShardedParam) -> None:
        slot = self._slots(bucket)[index]
        grad = sharded.param.grad
        again = bucket.staged[index]  # a second gradient for the same parameter in one backward
        if isinstance(slot, torch.Tensor):
            parts = self._across_chunks(grad, slot, sharded)
            slot.add_(parts) if again else slot.copy_(parts)
        else:
            parts = [sharded.spec.take(grad, r) for r in range(self.world_size)]
            torch._foreach_add_(slot, parts) if again else torch._foreach_copy_(slot, parts)
        sharded.param.grad = None

    @staticmethod
    def _across_chunks(grad: torch.Tensor, slot: torch.Tensor, sharded: ShardedParam) -> torch.Tensor:
        """``grad`` shaped like its ``slot`` across the chunks: each rank's rows, or (replicated) all of it for each."""
        return grad.reshape(1, -1).expand_as(slot) if sharded.spec.replicated else grad.reshape(slot.shape)

    def _stage_together(self, bucket: Bucket, indices: list[int]) -> None:
        """One multi-tensor copy for all of them."""
        slots = self._slots(bucket)
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for index in indices:
            sharded = bucket.params[index]
            slot, grad = slots[index], sharded.param.grad
            if isinstance(slot, torch.Tensor):
                targets.append(slot)
                sources.append(self._across_chunks(grad, slot, sharded))
            else:
                targets.extend(slot)
                sources.extend(sharded.spec.take(grad, r) for r in range(self.world_size))
        if targets:
            torch._foreach_copy_(targets, sources)
        for index in indices:
            bucket.params[index].param.grad = None

    def _stage_absent(self, bucket: Bucket, index: int) -> None:
        chunks = self._input_chunks(bucket)
        start = bucket.layout.offsets[index]
        chunks[:, start : start + bucket.params[index].spec.padded_numel].zero_()

    def _launch(self, bucket: Bucket) -> None:
        chunks = self._input_chunks(bucket)
        flags = chunks[:, bucket.layout.flags_offset :]
        flags.fill_(1)
        for index in bucket.missing:  # this rank has no gradient for it
            flags[:, index].zero_()
        if self.average_over > 1:
            chunks.div_(self.average_over)
        fresh = all(s.shard.grad is None for s in bucket.params)
        output = bucket.shard_grads if fresh else torch.empty_like(bucket.shard_grads)
        bucket.output = output
        bucket.work = self._reduce_scatter(bucket, output)
        if self.replicas is not None:  # then this rank's shards across the shard groups
            replicas, across = self.replicas, self._across_groups(bucket)
            if across is None:
                bucket.work = comm.Chained(bucket.work, [lambda: comm.all_reduce_sum(output, replicas)])
            else:  # at the bucket's wait, as the exact all-reduce
                flags, label = bucket.layout.chunk_numel - bucket.layout.flags_offset, bucket.label
                bucket.work = comm.Chained(bucket.work, [lambda: across.all_reduce_sum(output, replicas, label, flags)])
        # Bound the staging memory: the bucket launched two before this one must have released its input.
        if bucket.position >= 2:
            self._wait(self.buckets[bucket.position - 2])

    def _reduce_scatter(self, bucket: Bucket, output: torch.Tensor) -> comm.Pending:
        """Within the shard group; where it spans nodes and gradients are quantized, by node and then across nodes,
        the presence flags exact."""
        by_host = self.wire.by_host if self._quantizes(bucket) else None
        if by_host is None:
            return comm.reduce_scatter_sum(output, bucket.buffer, self.group, bucket.label)
        flags = bucket.layout.chunk_numel - bucket.layout.flags_offset
        feedback = self._feedback.setdefault(bucket.position, quantized.ErrorFeedback())
        return quantized.hierarchical_reduce_scatter(output, bucket.buffer, by_host, bucket.label, feedback, flags)

    def _quantizes(self, bucket: Bucket) -> bool:
        return bucket.position in self._quantized

    def _across_groups(self, bucket: Bucket) -> quantized.AcrossGroups | None:
        """The bucket's quantized all-reduce across the shard groups, where it is quantized."""
        if not self._quantizes(bucket):
            return None
        return self._replicated.setdefault(bucket.position, quantized.AcrossGroups())

    def _release_input(self, bucket: Bucket) -> None:
        self.pool.release(bucket.buffer)
        bucket.buffer = None
        if bucket.host_mirror is not None and bucket.output is bucket.shard_grads:  # final: stream it now
            self._copy_to_host(bucket)

    def _give_host_grads(self, buckets: list[Bucket]) -> None:
        """Offloaded: each bucket whose gradients are already in the masters' dtype gets a pinned mirror of its
        gradient shards, whose regions are its parameters' host gradients (no copy per parameter, and the mirror
        fills while backward runs); other buckets get a buffer per parameter."""
        mirrorable = [b for b in buckets if all(s.grad_to_host and s.master.dtype == b.dtype for s in b.params)]
        by_dtype = group_by(mirrorable, lambda b: b.dtype)
        for dtype, mirrored in by_dtype.items():
            mirrors = pinned_views([b.layout.chunk_numel for b in mirrored], dtype)
            for bucket, mirror in zip(mirrored, mirrors, strict=True):
                bucket.host_mirror = mirror
                for index, sharded in enumerate(bucket.params):
                    sharded.use_master_grad(bucket.layout.region(mirror, index, self.rank), streamed=True)
        super()._give_host_grads([b for b in buckets if b.host_mirror is None])

    def _flags(self, bucket: Bucket) -> torch.Tensor:
        return bucket.layout.flags(bucket.output)

    def _publish(self, bucket: Bucket, present: list[bool]) -> None:
        layout = bucket.layout
        for index, (sharded, flag) in enumerate(zip(bucket.params, present, strict=True)):
            if not flag:
                continue
            if bucket.output is not bucket.shard_grads:
                incoming = layout.region(bucket.output, index, self.rank)
                target = sharded.grad_storage
                if sharded.shard.grad is None:
                    target.copy_(incoming)
                else:
                    target.add_(incoming)
            self._hand_over(sharded)
        if bucket.host_mirror is not None and not bucket.streamed:  # accumulated into the shards just now
            self._copy_to_host(bucket)
        bucket.output = None


def reducer_for(stage: Stage) -> type[GradientReducer]:
    """The gradient policy of stage 1 or 2."""
    match stage:
        case Stage.OPTIMIZER:
            return AllReduceReducer
        case Stage.GRADIENTS:
            return ReduceScatterReducer
    raise ValueError(f"Stage {int(stage)} reduces gradients with `fully_shard`, not with a bucket reducer.")
