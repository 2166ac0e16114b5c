"""Labels: what a rank says it is doing at each barrier of the shared-memory channel, so that ranks that went
different ways fail at once, on every rank, instead of exchanging the wrong data or waiting for each other forever.

Every rank of a group must enter the channel's collectives in the same order. Under stage 3 that order is the order in
which the units are gathered (forward, backward) and their gradients reduced, and code that runs a part of the model on
some ranks only breaks it: a ``generate()`` that stops earlier on one rank, a branch or an expert taken by one rank,
one rank's extra forward. A rank would then pair its gather of one unit with a peer's gather of another, or wait in a
gather for a peer that went on to other collectives (Lightning's, gloo's), until the group's timeout: 30 minutes.

So each rank sends a label with its barrier's status byte and compares its peers' labels with its own: the first
barrier the ranks do not enter for the same reason raises :class:`DivergedError` on every rank, naming what each rank
was doing; a rank whose process ends tells its peers so (:data:`LEFT`), so that a peer still waiting for it fails at
once too. Stage 3 also makes every rank meet at the end of each forward of the whole module (:data:`END_OF_FORWARD`,
a Trainer step), so that a rank that finished its step early meets a peer still gathering, rather than leaving for
collectives the channel cannot see.

A label is the CRC-32 of its words: the same on every rank whatever order the labels were made in. Each process keeps
the words of the labels it made, which are its peers' too (every rank labels the same units).
"""

from __future__ import annotations

import zlib

_WORDS: dict[int, str] = {}  # label -> its words


class DivergedError(RuntimeError):
    """The ranks entered different collectives: they ran different code."""


def label(words: str) -> int:
    """The label of ``words``, which say what a collective is for (``"the all-gather of unit `h.0`"``)."""
    code = zlib.crc32(words.encode())
    _WORDS.setdefault(code, words)
    return code


def words(code: int) -> str:
    return _WORDS.get(code, f"a collective this rank does not know (label {code:#010x})")


ALL_GATHER = label("an all-gather")
ALL_REDUCE = label("an all-reduce")
REDUCE_SCATTER = label("a reduce-scatter")
END_OF_FORWARD = label("the end of a forward of the whole module (the end of a step's forward, under the Trainer)")
# what a rank's channel tells its peers as its process ends (at exit), when its script finished or raised
LEFT = label("the end of its process: its script finished, with fewer collectives than the others")
LEFT_FAILED = label("the end of its process, after an exception")


def unit_gather(module: str, unit: str) -> int:
    """The all-gather of the parameters of the unit at path ``unit`` (``""``: the root) of the module class named
    ``module``."""
    return label(f"the all-gather of {_unit(module, unit)}'s parameters")


def unit_reduce(module: str, unit: str) -> int:
    """The reduce-scatter of that unit's gradients."""
    return label(f"the reduce-scatter of {_unit(module, unit)}'s gradients")


def _unit(module: str, unit: str) -> str:
    return f"unit `{unit}` of {module}" if unit else f"{module} (the root unit)"


def diverged(rank: int, doing: dict[int, int]) -> DivergedError:
    """The error of ``rank``, which met its peers at a barrier where ``doing`` (rank -> label, every rank) differ."""
    return diverged_between(rank, {r: words(code) for r, code in doing.items()})


def diverged_between(rank: int, doing: dict[int, str]) -> DivergedError:
    """The error of ``rank``, which found its peers elsewhere: ``doing`` (rank -> what it was doing, every rank)."""
    what = "; ".join(f"rank {r}: {doing[r]}" for r in sorted(doing))
    return DivergedError(
        f"The ranks ran different code under ZeRO stage 3 and met in different collectives (seen on rank {rank}):"
        f" {what}. Every rank must run the same units in the same order, since each forward and backward of a unit"
        " gathers its parameters from all ranks. HINT: a Hugging Face `generate()` that stops earlier on some ranks"
        " needs `synced_gpus=True` (or leave it out: Hugging Face turns it on under sharding); run a branch or an"
        " expert on every rank (masking its result where it is not wanted), and give every rank the same number of"
        " forwards."
    )
