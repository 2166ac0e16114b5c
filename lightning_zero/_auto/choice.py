"""The choice: the first candidate, in the order of their traffic, whose model state fits each rank's budget beside
the activation reserve; and the table that says why."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from lightning_zero._auto.budget import Budget
from lightning_zero._auto.candidates import Candidate, Need, Offload, Workload, host_steps_first, needs, order
from lightning_zero.estimate import OPTIMIZER_STATES, format_bytes

DEFAULT_RESERVE = 0.25
"""The activation reserve by default: a quarter of each rank's memory for activations, module buffers and the
framework's own allocations (each candidate's buckets, gathered units and step temporaries are counted with it)..."""

RESERVE_FLOOR = 256 * 2**20
"""...and at least this much, but never more than half the memory: what a rank's memory group grew by beyond the
estimate once training ran on 2 CPU ranks (the framework's allocations after set-up, its libraries' pages; about 216
MiB a rank for ``bench_auto``'s 67 M parameter MLP under stage 3)."""


class AutoChoiceError(RuntimeError):
    """No candidate fits, or the one chosen no longer does."""


@dataclass(frozen=True, kw_only=True)
class AutoOptions:
    """What the user tells ``zero_auto``; see :meth:`from_options` for the forms each option takes."""

    max_stage: int = 3
    """The highest stage the choice may run."""

    offload: Offload = Offload.DISK
    """How far model state may move off the device: not at all, into host memory, or into files too."""

    activation_reserve: float | int | None = None
    """The part of each rank's memory kept out of the model state's reach: a fraction below 1, or bytes; ``None``
    (the default): ``DEFAULT_RESERVE`` of it, at least ``RESERVE_FLOOR`` and at most half."""

    optimizer: str = "adam"
    """The optimizer the estimate assumes until the configured one is known (a key of ``OPTIMIZER_STATES``)."""

    memory_per_rank: int | None = None
    """The bytes each rank may use, where they should not be measured (a machine shared with other jobs)."""

    @classmethod
    def from_options(
        cls,
        *,
        max_stage: object = 3,
        offload: object = True,
        activation_reserve: object = None,
        optimizer: object = "adam",
        memory_per_rank: object = None,
    ) -> AutoOptions:
        """The options checked: errors name the option and its value, and end with a HINT."""
        if isinstance(max_stage, bool) or max_stage not in (1, 2, 3):
            raise ValueError(
                f"`max_stage={max_stage!r}` is not a ZeRO stage. HINT: pass 1, 2 or 3 (the default, 3, lets"
                " zero_auto shard parameters too)."
            )
        match offload:
            case False | None | "none":
                allowed = Offload.NONE
            case "cpu":
                allowed = Offload.HOST
            case True | "disk":
                allowed = Offload.DISK
            case _:
                raise ValueError(
                    f"`offload={offload!r}` is not an offload zero_auto may choose. HINT: pass True (the default:"
                    ' host memory or files), "cpu" (host memory, no files) or False (no offload).'
                )
        if isinstance(activation_reserve, bool) or not (
            activation_reserve is None
            or (isinstance(activation_reserve, float) and 0 <= activation_reserve < 1)
            or (isinstance(activation_reserve, int) and activation_reserve >= 0)
        ):
            raise ValueError(
                f"`activation_reserve={activation_reserve!r}` is neither a fraction of a rank's memory nor bytes."
                f" HINT: pass a float from 0 to below 1, a whole number of bytes, or None (the default:"
                f" {DEFAULT_RESERVE} of the memory, at least {format_bytes(RESERVE_FLOOR)}, at most half)."
            )
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"`optimizer={optimizer!r}` is not an optimizer the estimate knows. HINT: pass the one"
                f" `configure_optimizers` returns, as one of {list(OPTIMIZER_STATES)}."
            )
        if memory_per_rank is not None and (
            isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, int) or memory_per_rank < 1
        ):
            raise ValueError(
                f"`memory_per_rank={memory_per_rank!r}` is not a number of bytes. HINT: pass a positive whole number"
                " of bytes, or None to measure each rank's memory."
            )
        return cls(
            max_stage=max_stage,  # type: ignore[arg-type]
            offload=allowed,
            activation_reserve=activation_reserve,  # type: ignore[arg-type]
            optimizer=optimizer,
            memory_per_rank=memory_per_rank,
        )

    def reserve_of(self, memory: int) -> int:
        """The reserve's bytes out of a rank's ``memory``."""
        if self.activation_reserve is None:
            return min(max(math.ceil(DEFAULT_RESERVE * memory), RESERVE_FLOOR), memory // 2)
        if isinstance(self.activation_reserve, float):
            return math.ceil(self.activation_reserve * memory)
        return self.activation_reserve

    def admits(self, candidate: Candidate) -> bool:
        return candidate.stage <= self.max_stage and candidate.offload.value <= self.offload.value


class Verdict(Enum):
    """What the choice made of a candidate."""

    CHOSEN = "chosen"
    FITS = "fits"  # fits, after the one chosen
    MEMORY = "too large for memory"
    HOST = "too large for host memory"
    DISK = "too large for the disk"
    CAPPED = "not allowed"  # beyond ``max_stage`` or ``offload``


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    need: Need
    verdict: Verdict


@dataclass(frozen=True)
class AutoChoice:
    """The choice and its grounds, for scripts (``strategy.auto_choice``) and for the table logged at set-up."""

    candidate: Candidate
    rows: tuple[Row, ...]
    budget: Budget
    reserve: int  # bytes of ``budget.memory`` kept for activations
    workload: Workload

    @property
    def name(self) -> str:
        return self.candidate.label

    @property
    def reason(self) -> str:
        """Why this candidate: those before it that the options allow did not fit."""
        room = f"{format_bytes(self.budget.memory - self.reserve)} of memory per rank after the activation reserve"
        skipped = [row for row in self.rows if row.verdict not in (Verdict.CHOSEN, Verdict.FITS, Verdict.CAPPED)]
        if host_steps_first(self.workload.optimizer, self.budget.host is None):
            weighed = "in order of traffic, those stepping on the host first (on CPU ranks, torch's fused kernel)"
        else:
            weighed = "in order of traffic"
        if not skipped:
            return f"{self.name} is the first candidate allowed, {weighed}, and fits in {room}"
        larger = ", ".join(f"{row.candidate.label} ({row.verdict.value})" for row in skipped)
        return f"{self.name} is the first candidate, {weighed}, that fits in {room}; before it: {larger}"

    def table(self) -> str:
        """A markdown table: each candidate's bytes per rank by where they live, and the verdict."""
        on_cpu = self.budget.host is None
        where = ["memory"] if on_cpu else ["device", "host"]
        header = ["candidate", *(f"{w} per rank" for w in where), "disk per rank", "verdict"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in self.rows:
            memory = [row.need.memory(True)] if on_cpu else [row.need.memory(False), row.need.host]
            cells = [f"`{row.candidate.label}`", *map(format_bytes, [*memory, row.need.disk]), row.verdict.value]
            lines.append("| " + " | ".join(cells) + " |")
        budget, w = self.budget, self.workload
        room = f"budget per rank: {format_bytes(budget.memory)} ({budget.source})"
        room += f", of which {format_bytes(self.reserve)} reserved for activations"
        if budget.host is not None:
            room += f"; host {format_bytes(budget.host)}"
        if budget.disk is not None:
            room += f"; disk {format_bytes(budget.disk)}"
        if w.working is not None:
            room += (
                f"; {where[0]} per rank includes the step's working buffers (largest unit {w.working.largest_unit:,}"
                f" parameters, root {w.working.root_params:,}; {w.working.parameter_tensors:,} parameter tensors)"
            )
        model = (
            f"{w.num_params:,} parameters ({w.trainable_params:,} trainable), precision {w.precision}, optimizer"
            f" {w.optimizer}, {w.num_ranks} rank(s)"
        )
        return "\n".join([f"zero_auto chose `{self.name}`: {self.reason}.", model, room, *lines])


def decide(workload: Workload, budget: Budget, options: AutoOptions) -> AutoChoice:
    """The first candidate the options admit whose need fits ``budget`` beside the reserve; fails with
    :class:`AutoChoiceError` when none does."""
    reserve = options.reserve_of(budget.memory)
    on_cpu = budget.host is None
    chosen: Candidate | None = None
    rows = []
    by_candidate = needs(workload, on_cpu)
    for candidate in order(workload.optimizer, on_cpu):
        need = by_candidate[candidate]
        if not options.admits(candidate):
            verdict = Verdict.CAPPED
        elif need.memory(on_cpu) + reserve > budget.memory:
            verdict = Verdict.MEMORY
        elif budget.host is not None and need.host > budget.host:
            verdict = Verdict.HOST
        elif need.disk and (budget.disk is None or need.disk > budget.disk):
            verdict = Verdict.DISK
        elif chosen is None:
            verdict, chosen = Verdict.CHOSEN, candidate
        else:
            verdict = Verdict.FITS
        rows.append(Row(candidate, need, verdict))
    if chosen is None:
        raise AutoChoiceError(_nothing_fits(rows, budget, reserve, options))
    return AutoChoice(chosen, tuple(rows), budget, reserve, workload)


def _nothing_fits(rows: list[Row], budget: Budget, reserve: int, options: AutoOptions) -> str:
    allowed = [row for row in rows if row.verdict is not Verdict.CAPPED]
    smallest = min(allowed, key=lambda row: row.need.memory(budget.host is None))
    needed = ", ".join(f"{row.candidate.label} {row.verdict.value}" for row in allowed)
    hints = ["a larger memory limit or more ranks", "a lower `activation_reserve`"]
    if options.max_stage < 3:
        hints.append("`max_stage=3`")
    if options.offload is not Offload.DISK:
        hints.append("`offload=True` (host memory and files)")
    return (
        f"zero_auto found no candidate that fits: each rank may use {format_bytes(budget.memory)}"
        f" ({budget.source}), {format_bytes(reserve)} of it reserved for activations"
        f" (`activation_reserve={options.activation_reserve!r}`); the least model state, {smallest.candidate.label}'s,"
        f" needs {format_bytes(smallest.need.memory(budget.host is None))} in memory. Allowed: {needed}."
        f" HINT: try {', '.join(hints)}."
    )


def optimizer_key(optimizer: object) -> str | None:
    """The ``OPTIMIZER_STATES`` key of a torch optimizer; ``None`` for one the estimate does not know."""
    match type(optimizer).__name__:
        case "Adam" | "AdamW" as name:
            return name.lower()
        case "SGD":
            momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)  # type: ignore[attr-defined]
            return "sgd-momentum" if momentum else "sgd"
    return None


def check_optimizer(choice: AutoChoice, optimizer: str, options: AutoOptions) -> None:
    """Once the configured optimizer is known: fail, naming the candidate that fits, where the one chosen for the
    assumed optimizer holds too little for it (an optimizer with more state per parameter)."""
    if optimizer == choice.workload.optimizer:
        return
    actual = replace(choice.workload, optimizer=optimizer)
    try:
        again = decide(actual, choice.budget, options)
    except AutoChoiceError as error:
        raise AutoChoiceError(f"With the configured optimizer, {optimizer}: {error}") from None
    still = next(row.verdict for row in again.rows if row.candidate is choice.candidate)
    if still not in (Verdict.CHOSEN, Verdict.FITS):
        raise AutoChoiceError(
            f"zero_auto chose {choice.name} for `optimizer={choice.workload.optimizer!r}`, and the configured optimizer"
            f" is {optimizer}, whose state does not fit beside it: {again.name} would. HINT: pass"
            f" `optimizer={optimizer!r}` to zero_auto."
        )
