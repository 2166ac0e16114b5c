"""Command line: ``python -m lightning_zero consolidate CHECKPOINT_DIR OUTPUT_FILE [--weights-only]``."""

from __future__ import annotations

import argparse
import sys

from lightning_zero._distributed_checkpoint import CheckpointError
from lightning_zero.consolidate import consolidate_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser("consolidate", help="write a sharded checkpoint directory as one file")
    consolidate.add_argument("checkpoint_dir")
    consolidate.add_argument("output_file")
    consolidate.add_argument("--weights-only", action="store_true", help="leave out optimizer state")
    args = parser.parse_args(argv)
    try:
        output = consolidate_checkpoint(args.checkpoint_dir, args.output_file, weights_only=args.weights_only)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
