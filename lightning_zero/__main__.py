"""Command line.

``python -m lightning_zero consolidate CHECKPOINT_DIR OUTPUT_FILE [--weights-only] [--trust-pickle] [--quiet]`` writes
a sharded checkpoint directory as one ordinary file. ``--trust-pickle`` lets a checkpoint you trust import and run what
its pickled files name (custom classes among its hyper-parameters, say); without it only tensors, plain containers and
DCP's own classes load. On a terminal a progress bar shows the reading; ``--quiet`` prints nothing but errors.

``python -m lightning_zero estimate (--params 7.5e9 | --module CLASS_PATH [--ARG VALUE ...]) --ranks 64 [--nodes 8]
[--precision bf16-true --master-weights] [--offload] [--disk] [--optimizer adam]`` prints the model-state bytes per rank
and per node of DDP and each stage as a markdown table (``--disk``: with ZeRO-Infinity's row and disk columns). With
``--module``, further ``--ARG VALUE`` pairs are the class's init arguments (``--size 1b``) and the parameters are
counted on the meta device, without allocating them.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero.consolidate import consolidate_checkpoint
from lightning_zero.estimate import OPTIMIZER_STATES, count_parameters, estimate, format_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_zero", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser("consolidate", help="write a sharded checkpoint directory as one file")
    consolidate.add_argument("checkpoint_dir")
    consolidate.add_argument("output_file")
    consolidate.add_argument("--weights-only", action="store_true", help="leave out optimizer state")
    consolidate.add_argument(
        "--trust-pickle",
        action="store_true",
        help="let the checkpoint's pickled files import and run what they name: only for a checkpoint you trust",
    )
    consolidate.add_argument(
        "--quiet", action="store_true", help="print nothing but errors (no progress bar, which logs never get anyway)"
    )
    _add_estimate_parser(commands)
    args, extra = parser.parse_known_args(argv)
    if args.command == "estimate":
        return _estimate(parser, args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        output = consolidate_checkpoint(
            args.checkpoint_dir,
            args.output_file,
            weights_only=args.weights_only,
            trust_pickle=args.trust_pickle,
            progress=not args.quiet,
        )
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"wrote {output}")
    return 0


def _add_estimate_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "estimate",
        help="model-state bytes per rank and per node of ddp and each stage (the ZeRO paper's formulas)",
        description="Further `--ARG VALUE` pairs after `--module` are the module's init arguments, e.g. `--size 1b`.",
        allow_abbrev=False,  # `--opt` must reach the module as an init argument, not abbreviate `--optimizer`
    )
    count = parser.add_mutually_exclusive_group(required=True)
    count.add_argument("--params", type=float, help="number of parameters, e.g. 7.5e9")
    count.add_argument("--module", help="import path of a module class whose parameters to count on the meta device")
    parser.add_argument("--ranks", type=int, required=True, help="data-parallel ranks over all nodes")
    parser.add_argument("--nodes", type=int, default=1, help="machines the ranks are spread over (default 1)")
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision flag (default 32-true)")
    parser.add_argument(
        "--master-weights", action="store_true", help="fp32 master weights and optimizer state for 16-bit parameters"
    )
    parser.add_argument("--offload", action="store_true", help="count master weights, optimizer state as host memory")
    parser.add_argument(
        "--disk", action="store_true", help="add ZeRO-Infinity's row: stage 3's model state in files on disk"
    )
    parser.add_argument("--optimizer", default="adam", choices=list(OPTIMIZER_STATES), help="default adam")
    parser.add_argument(
        "--shard-group-size",
        help="hybrid sharding: also the rows of stages sharding within groups of this many ranks ('node': per node)",
    )


def _estimate(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    if extra and args.module is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)} (init arguments go with --module)")
    try:
        if args.module is not None:
            init_args = _init_args(parser, extra)
            num_params, trainable = count_parameters(args.module, init_args)
            source = f" of {args.module}({', '.join(f'{k}={v!r}' for k, v in init_args.items())})"
        else:
            num_params = trainable = round(args.params)
            source = ""
        options = {
            "num_ranks": args.ranks,
            "num_nodes": args.nodes,
            "precision": args.precision,
            "master_weights": args.master_weights,
            "offload": args.offload,
            "optimizer": args.optimizer,
            "trainable_params": trainable,
            "disk": args.disk,
        }
        estimates = estimate(num_params, **options)
        if args.shard_group_size is not None:
            per_node = args.ranks // args.nodes
            group = per_node if args.shard_group_size == "node" else _positive_int(args.shard_group_size)
            hybrid = estimate(num_params, **options, shard_group_size=group)
            estimates.update({f"{k} (groups of {group})": v for k, v in hybrid.items() if k != "ddp"})
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    nodes = f"{args.nodes} node" + ("s" if args.nodes > 1 else "")
    frozen = f", {num_params - trainable:,} of them frozen" if trainable < num_params else ""
    print(
        f"Model state of {num_params:,} parameters{source}{frozen} on {args.ranks} ranks ({nodes}),"
        f" precision {args.precision}{' with fp32 master weights' if args.master_weights else ''},"
        f" {args.optimizer}{', optimizer state offloaded to host memory' if args.offload else ''}:\n"
    )
    print(format_table(estimates))
    notes = ["Activations, buffers, communication buckets and, under zero3, the units gathered at work come on top."]
    if args.master_weights:
        notes.append(
            "The ddp row is the ZeRO paper's baseline (Lightning's DDP keeps no master weights); zero3's fp32 shards"
            " are its master weights, gathered as bf16."
        )
    if args.offload:
        notes.append(
            "Host columns: master weights and optimizer state, as `offload_optimizer=True` keeps them; offloaded runs"
            " also keep a host copy of each gradient shard, and fp32 masters of an fp32 module's shards."
        )
    if args.disk:
        notes.append(
            "zero3_infinity (`offload_parameters='disk'`): its model state lives in files under `offload_dir`; device"
            " and host memory hold the units at work, read ahead of their gathers, and `max_in_cpu` parameter elements."
        )
    print("\n" + "\n".join(notes))
    return 0


def _positive_int(value: str) -> int:
    try:
        return int(value)
    except ValueError as error:
        raise ValueError(
            f"`--shard-group-size {value}` is not a number of ranks. HINT: pass an integer that divides --ranks, or"
            " 'node'."
        ) from error


def _init_args(parser: argparse.ArgumentParser, extra: list[str]) -> dict[str, object]:
    """``["--size", "1b", "--hidden=256"]`` -> ``{"size": "1b", "hidden": 256}`` (values read as YAML)."""
    init_args: dict[str, object] = {}
    tokens = iter(extra)
    for token in tokens:
        if not token.startswith("--") or len(token) == 2:
            parser.error(f"expected an init argument `--NAME VALUE` after --module, got {token!r}")
        name, equals, value = token[2:].partition("=")
        if not equals:
            value = next(tokens, None)
            if value is None:
                parser.error(f"init argument {token} has no value")
        init_args[name.replace("-", "_")] = yaml.safe_load(value)
    return init_args


if __name__ == "__main__":
    sys.exit(main())
