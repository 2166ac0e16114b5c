"""The processes that save or load one checkpoint together, and how they agree on an outcome."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_zero._checkpoint.error import CheckpointError

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """The processes that save or load one checkpoint together: every rank of the default process group (the one DCP
    uses), or this process alone (consolidation; ``torch.distributed`` not initialized)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def of_default_group(cls) -> Ranks:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def all_gather(self, value: T) -> list[T]:
        if self.size == 1:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def on_first(self, action: Callable[[], T], what: str) -> T:
        """Rank 0 runs ``action``; every rank returns its result, or raises where it failed: rank 0 its own error,
        the others the same :class:`CheckpointError` where it is one, else a :class:`CheckpointError` quoting it."""
        result: Any = None
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                result = action()
            except Exception as error:
                failure = error
        if self.size > 1:
            shared = [result, None if failure is None else _quoted(failure, what)]
            dist.broadcast_object_list(shared, src=0)
            result, message = shared
            if message is not None and failure is None:
                raise CheckpointError(message)
        if failure is not None:
            raise failure
        return result

    def agree(self, error: CheckpointError | None) -> None:
        """Raise on every rank the first error any rank met, or return on every rank."""
        messages = self.all_gather(None if error is None else str(error))
        first = next((message for message in messages if message is not None), None)
        if first is None:
            return
        if error is not None and str(error) == first:
            raise error
        raise CheckpointError(first)


def _quoted(failure: BaseException, what: str) -> str:
    """What the other ranks raise for rank 0's ``failure`` while it did ``what``."""
    if isinstance(failure, CheckpointError):
        return str(failure)
    return f"Rank 0 failed to {what}: {type(failure).__name__}: {failure}"


ALONE = Ranks()  # this process by itself
