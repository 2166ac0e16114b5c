"""Grouping tensors (or anything) by a key such as their dtype, so that each group makes one flat buffer or one
collective call."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def group_by(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """``items`` in lists by ``key``, each list in the items' order, the keys in the order they first appear (so every
    rank, given the same items, forms the same groups in the same order)."""
    groups: dict[K, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
