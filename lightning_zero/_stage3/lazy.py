"""Deferred initialisation: tensors that record what is done to them, and give the values later, one at a time.

Vocabulary:

- *record*: one lazily built storage: the device eager construction would have put it on, how it was born (a fresh
  ``torch.empty``, a copy of real values, or the output of an operation on other records) and the in-place
  operations applied to it since, in order: its ``steps``, an immutable tuple, so that a snapshot of it is a value.
- *lazy tensor*: a :class:`LazyTensor`, a view of a record's storage. It has the shape, strides, dtype and device
  eager construction would have given it, and no data: ``is_meta`` is false, so code that skips meta tensors
  (``torch.nn.init.trunc_normal_``, Hugging Face's ``_init_weights``) runs on it as on a real tensor. Every aten
  operation on it is recorded, not run: in-place ones become steps of its record, others give lazy tensors of new
  records (or views of the same one).
- *draw*: the state of the random generator an operation would have drawn from, taken before it; the operation runs
  once at once on a scratch tensor of the same layout, so that the generator moves on exactly as in eager
  construction and later draws (the next layer's, dropout's) are the same.
- *realize*: run a record's steps on a real tensor, with each draw's generator state: the values eager construction
  gave, bit for bit (same operations, same layouts, same device, same generator states).
- *forced*: an operation whose result depends on values (``.item()``, ``torch.equal``, a mask's ``any()``, an
  operation with no meta kernel) realizes its lazy inputs and runs for real.

An operation that writes a whole record without reading it (``normal_``, ``uniform_``, ``fill_``, ``zero_``,
``copy_``, ...) starts the record's history again, so the ``torch.empty`` or the values it was born with are let go:
a record holds real memory only for the source tensors a user copied in (a ``load_state_dict``) and for values
written by a forced in-place operation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten

# operations that read only the layout of their lazy inputs, not their values
_LAYOUT_ONLY = {
    aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones, aten.new_full,
    aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like, aten.randint_like,
}  # fmt: skip
# in-place operations that give a tensor other storage, which a record cannot follow
_RESIZES = {aten.set_, aten.resize_, aten.resize_as_}
# in-place operations whose result does not depend on what the tensor held
_OVERWRITES = {
    aten.fill_, aten.zero_, aten.copy_, aten.normal_, aten.uniform_, aten.random_, aten.exponential_, aten.cauchy_,
    aten.log_normal_, aten.geometric_, aten.bernoulli_,
}  # fmt: skip


@dataclass(frozen=True)
class Geometry:
    """Where a view lies in its record's storage, in elements."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(tensor: torch.Tensor) -> Geometry:
        return Geometry(tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def covers(self, elements: int) -> bool:
        """Whether the view is every element of a storage of ``elements``, each once."""
        if self.offset != 0 or math.prod(self.size) != elements:
            return False
        expected = 1
        for stride, size in sorted((st, sz) for sz, st in zip(self.size, self.stride, strict=True) if sz != 1):
            if stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True)
class Ref:
    """A lazy argument of a recorded operation: a view of ``record`` as it was after ``steps`` (``None``: the record
    the operation writes, as it is when the operation runs)."""

    record: Record
    steps: tuple[Step, ...] | None
    view: Geometry


@dataclass(frozen=True)
class Draw:
    """A generator's state before a random operation; ``explicit``: the operation was given that generator."""

    device: torch.device
    state: torch.Tensor
    explicit: bool


@dataclass(frozen=True)
class Call:
    """One aten operation, with :class:`Ref` in place of lazy tensors."""

    func: Any  # an OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    draw: Draw | None

    def run(self, resolve: Callable[[Ref], torch.Tensor]) -> Any:
        args, kwargs = pytree.tree_map_only(Ref, resolve, (self.args, self.kwargs))
        with _drawing(self.draw, kwargs):
            return self.func(*args, **kwargs)


@dataclass(frozen=True)
class Empty:
    """Born uninitialised (``torch.empty``): eager construction's values are whatever memory held."""


@dataclass(frozen=True)
class Source:
    """Born as a copy of real values (a parameter created from computed values, a forced write)."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Output:
    """Born as output ``index`` of an operation on other records."""

    call: Call
    index: int | None  # None: the operation returns one tensor


@dataclass(frozen=True)
class InPlace:
    """An in-place operation on the record (its lazy target is a :class:`Ref` with ``steps=None``)."""

    call: Call


Step = Empty | Source | Output | InPlace


class Record:
    """One lazily built storage (see the module's vocabulary)."""

    def __init__(self, meta: torch.Tensor, device: torch.device, birth: Empty | Source | Output) -> None:
        self.meta = meta  # a meta tensor over the whole storage, offset 0: views of it are the record's lazy tensors
        self.device = device
        self.steps: tuple[Step, ...] = (birth,)

    @property
    def elements(self) -> int:
        return self.meta.untyped_storage().nbytes() // self.meta.element_size()

    @property
    def initialised(self) -> bool:
        """Whether anything gave it values: a record born empty and never written is garbage under eager too."""
        return not (len(self.steps) == 1 and isinstance(self.steps[0], Empty))

    def shares_storage(self, meta: torch.Tensor) -> bool:
        return meta.untyped_storage()._cdata == self.meta.untyped_storage()._cdata

    def write(self, call: Call, target: Geometry, reads_self: bool) -> None:
        step = InPlace(call)
        if call.func.overloadpacket in _OVERWRITES and not reads_self and target.covers(self.elements):
            self.steps = (Empty(), step)  # what it held before cannot matter any more
        else:
            self.steps = (*self.steps, step)

    def realize(
        self,
        steps: tuple[Step, ...] | None = None,
        memo: dict[int, torch.Tensor] | None = None,
        arena: Arena | None = None,
    ) -> torch.Tensor:
        """The storage's values after ``steps`` (by default all of them), as a real tensor laid out as ``meta``;
        in ``arena``'s block if given (the records it depends on get memory of their own)."""
        steps = self.steps if steps is None else steps
        memo = {} if memo is None else memo
        if id(steps) in memo:
            return memo[id(steps)]
        meta = self.meta
        buffer = (arena or Arena()).take(meta.size(), meta.stride(), meta.dtype, self.device)

        def resolve(ref: Ref) -> torch.Tensor:
            base = buffer if ref.steps is None else ref.record.realize(ref.steps, memo)
            return base.as_strided(ref.view.size, ref.view.stride, ref.view.offset)

        for step in steps:
            if isinstance(step, Source):
                buffer.copy_(step.tensor)
            elif isinstance(step, Output):
                result = step.call.run(resolve)
                buffer.copy_(result if step.index is None else result[step.index])
            elif isinstance(step, InPlace):
                step.call.run(resolve)
        memo[id(steps)] = buffer
        return buffer


class Arena:
    """Memory for one tensor at a time, one block per device, grown to the largest asked for. Building a model takes
    and drops a tensor of each parameter's size, once or twice per parameter: from fresh allocations each time, small
    allocations made in between (a generator state, a record) pin glibc's heap, and its resident size grows by about
    the model's size; from one block, it stays one parameter."""

    def __init__(self) -> None:
        self._blocks: dict[torch.device, torch.Tensor] = {}

    def take(
        self, size: Sequence[int], stride: Sequence[int] | None, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor of that layout (``stride=None``: contiguous), over the start of the device's block
        (valid until the next take)."""
        stride = stride if stride is not None else [math.prod(size[i + 1 :]) for i in range(len(size))]
        span = 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) if all(size) else 0
        nbytes = span * dtype.itemsize
        block = self._blocks.get(device)
        if block is None or block.numel() < nbytes:
            self._blocks.pop(device, None)
            self._blocks[device] = block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return block[:nbytes].view(dtype).as_strided(size, stride)

    def release(self) -> None:
        self._blocks.clear()


SCRATCH = Arena()  # where random operations on lazy tensors run once, to move the generator on; emptied at set-up


class LazyTensor(torch.Tensor):
    """A view of a :class:`Record`: layout and device of a real tensor, no data; aten operations are recorded."""

    _meta: torch.Tensor  # a meta view of the record's meta storage, with this tensor's layout (never `record.meta`)
    _record: Record

    @staticmethod
    def __new__(cls, meta: torch.Tensor, record: Record, requires_grad: bool = False) -> LazyTensor:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, meta.size(), strides=meta.stride(), storage_offset=meta.storage_offset(), dtype=meta.dtype,
            device=record.device, requires_grad=requires_grad,
        )  # fmt: skip
        tensor._meta = meta
        tensor._record = record
        return tensor

    @staticmethod
    def born(like: torch.Tensor, birth: Empty | Source, requires_grad: bool = False) -> LazyTensor:
        """A lazy tensor standing for ``like`` (its layout, dtype and device), born as ``birth`` says."""
        meta = torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device="meta")
        return LazyTensor(aten.alias(meta), Record(meta, like.device, birth), requires_grad)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) not in memo:
            with torch.no_grad():
                copy = self.clone()
            memo[id(self)] = torch.nn.Parameter(copy, self.requires_grad) if getattr(self, "_is_param", False) else copy
        return memo[id(self)]

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``param.data = value`` (``Module._apply``, Hugging Face's loaders): the same lazy tensor, now a view of
        ``value``'s record (a real ``value`` is born as a copy)."""
        if not isinstance(value, LazyTensor):
            value = LazyTensor.born(value, Source(value.detach()))
        torch._C.TensorBase.data.__set__(self, value)  # the layout and dtype this tensor reports
        self._meta, self._record = value._meta, value._record

    @property
    def geometry(self) -> Geometry:
        return Geometry.of(self._meta)

    def real_view(self, arena: Arena | None = None) -> torch.Tensor:
        """This view's values, laid out as this tensor, on the record's device (in ``arena``'s block if given)."""
        view = self.geometry
        return self._record.realize(arena=arena).as_strided(view.size, view.stride, view.offset)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return _record(func, args, kwargs or {})


def _record(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    lazies = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, LazyTensor)]
    written = _written(func, args, kwargs)
    if func.overloadpacket in _RESIZES and any(isinstance(t, LazyTensor) for t in written):
        raise RuntimeError(
            f"`{func.overloadpacket.__name__}` on a parameter while the model is built for stage 3 changes its"
            " storage, which stage 3 replays per parameter only while the layout stays. HINT: create the parameter"
            " with its final shape, or build this model eagerly (`Trainer.init_module(empty_init=False)`,"
            " `fabric.init_module(empty_init=False)`, or in `__init__` rather than `configure_model`)."
        )
    if torch.Tag.inplace_view in func.tags and all(isinstance(t, LazyTensor) for t in written):
        return _restride(func, args, kwargs)
    if any(not isinstance(t, LazyTensor) for t in written) or len({id(t._record) for t in written}) > 1:
        return _forced(func, args, kwargs)  # a real tensor receives values computed from lazy ones, or two records
    try:
        meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, _as_meta, (args, kwargs))
        out = func(*meta_args, **meta_kwargs)
    except (NotImplementedError, RuntimeError):
        return _forced(func, args, kwargs)  # no meta kernel, or a value is needed (`.item()`)
    if not all(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
        return _forced(func, args, kwargs)  # a Python value (`torch.equal`)
    device = (written or lazies)[0].device
    draw = _draw(func, kwargs, device)
    if draw is not None:
        _advance(func, args, kwargs)
    if written:
        target = written[0]
        call = _call(func, args, kwargs, draw, target._record)
        reads_self = any(t is not target and t._record is target._record for t in lazies)
        target._record.write(call, target.geometry, reads_self)
        return pytree.tree_map_only(torch.Tensor, lambda t: _lazy_for(t, written), out)
    return _outputs(func, args, kwargs, draw, out, lazies, device)


def _restride(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An in-place view operation (``t_``, ``unsqueeze_``, ...) changes a lazy tensor's layout, not its record's
    values: the same change on its meta view and on the tensor itself."""
    meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, _as_meta, (args, kwargs))
    func(*meta_args, **meta_kwargs)
    with torch._C._DisableTorchDispatch():
        return func(*args, **kwargs)


def _outputs(
    func: Any, args: Any, kwargs: Any, draw: Draw | None, out: Any, lazies: list[LazyTensor], device: torch.device
) -> Any:
    """Views of an input stay views of its record; every other output is born as an output of the call."""
    call = _call(func, args, kwargs, draw, None)
    single = isinstance(out, torch.Tensor)
    outputs = [out] if single else list(out)
    wrapped = []
    for index, meta in enumerate(outputs):
        base = next((t._record for t in lazies if t._record.shares_storage(meta)), None)
        if base is not None:
            wrapped.append(LazyTensor(meta, base))
            continue
        fresh = torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device="meta")
        out_device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else device
        record = Record(fresh, out_device, Output(call, None if single else index))
        wrapped.append(LazyTensor(aten.alias(fresh), record))  # its own view: `t_()` may change it, not the record
    return wrapped[0] if single else type(out)(wrapped)


def _lazy_for(meta: torch.Tensor, written: list[LazyTensor]) -> torch.Tensor:
    """An in-place operation returns its target."""
    return next(t for t in written if t._meta is meta or t._record.shares_storage(meta))


def _call(func: Any, args: Any, kwargs: Any, draw: Draw | None, target: Record | None) -> Call:
    layout_only = func.overloadpacket in _LAYOUT_ONLY

    def ref(tensor: LazyTensor) -> Any:
        if layout_only:  # only its layout is read: a stand-in of that layout, nothing recorded behind it
            return _Stand(tensor.size(), tensor.stride(), tensor.dtype, tensor.device)
        steps = None if tensor._record is target else tensor._record.steps
        return Ref(tensor._record, steps, tensor.geometry)

    args, kwargs = pytree.tree_map_only(LazyTensor, ref, (args, kwargs))
    args, kwargs = pytree.tree_map_only(_Stand, _Stand.tensor, (args, kwargs)) if layout_only else (args, kwargs)
    return Call(func, tuple(args), dict(kwargs), draw)


@dataclass(frozen=True)
class _Stand:
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def tensor(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


def _forced(func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``func`` for real on its lazy inputs' values; a lazy tensor it writes is born again from the result."""
    written = [t for t in _written(func, args, kwargs) if isinstance(t, LazyTensor)]
    buffers = {id(t._record): t._record.realize() for t in written}

    def real(tensor: LazyTensor) -> torch.Tensor:
        if id(tensor._record) in buffers:
            view = tensor.geometry
            return buffers[id(tensor._record)].as_strided(view.size, view.stride, view.offset)
        return tensor.real_view()

    real_args, real_kwargs = pytree.tree_map_only(LazyTensor, real, (args, kwargs))
    out = func(*real_args, **real_kwargs)
    for tensor in written:
        tensor._record.steps = (Source(buffers[id(tensor._record)]),)
    return pytree.tree_map_only(torch.Tensor, lambda t: _lazy_for_real(t, written), out) if written else out


def _lazy_for_real(result: torch.Tensor, written: list[LazyTensor]) -> torch.Tensor:
    """A forced in-place operation returns its lazy target, not the buffer it wrote."""
    for tensor in written:
        buffer = tensor._record.steps[0]
        assert isinstance(buffer, Source)
        if result.untyped_storage()._cdata == buffer.tensor.untyped_storage()._cdata:
            return tensor
    return result


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors ``func`` writes into (its schema's mutable arguments)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _as_meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._meta if isinstance(tensor, LazyTensor) else tensor.to("meta")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _draw(func: Any, kwargs: dict[str, Any], device: torch.device) -> Draw | None:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    generator = kwargs.get("generator")
    explicit = generator is not None
    generator = generator if explicit else _default_generator(device)
    return Draw(generator.device, generator.get_state(), explicit)


def _advance(func: Any, args: Any, kwargs: Any) -> None:
    """Run a random operation once on scratch tensors of its lazy inputs' layout (values where it reads them), so
    that the generator moves on as in eager construction."""
    written = _written(func, args, kwargs)
    arena: Arena | None = SCRATCH  # for one of them: the others are rare and small

    def scratch(tensor: LazyTensor) -> torch.Tensor:
        nonlocal arena
        if any(t is tensor for t in written) or func.overloadpacket in _LAYOUT_ONLY:
            taken = (arena or Arena()).take(tensor.size(), tensor.stride(), tensor.dtype, tensor.device)
            arena = None
            return taken if func.overloadpacket in _OVERWRITES else taken.zero_()
        return tensor.real_view()

    scratch_args, scratch_kwargs = pytree.tree_map_only(LazyTensor, scratch, (args, kwargs))
    func(*scratch_args, **scratch_kwargs)


@contextmanager
def _drawing(draw: Draw | None, kwargs: dict[str, Any]) -> Iterator[None]:
    """Run with the generator as it was when the operation was recorded, leaving the live generators untouched."""
    if draw is None:
        yield
    elif draw.explicit:
        generator = torch.Generator(device=draw.device)
        generator.set_state(draw.state)
        kwargs["generator"] = generator
        yield
    else:
        generator = _default_generator(draw.device)
        live = generator.get_state()
        generator.set_state(draw.state)
        try:
            yield
        finally:
            generator.set_state(live)
