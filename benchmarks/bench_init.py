"""Building a large model for stage 3: time and peak host memory per rank, eager construction against the strategy's
construction context.

Run from the repository root: ``python -m benchmarks.bench_init [--hidden 2048 --layers 16 --vocab 32000]``.

A Hugging Face Llama from a config (the defaults give 0.94 B parameters, 3.8 GB in fp32) is built by 2 CPU processes
in two ways, each in its own launch so that each peak is its own:

- **eager**: ``LlamaForCausalLM(config)`` on every rank, as under ``"ddp"``: every rank holds the whole model;
- **zero3**: the same line under Fabric's ``fabric.init_module()`` with ``strategy="zero3"``, then
  ``fabric.setup_module``: parameters are recorded without memory, and after sharding rank 0 replays each one and
  broadcasts it, every rank keeping its rows.

Printed per way: seconds to construct, seconds to set up (sharding and giving values), each rank's peak resident
memory (``ru_maxrss``, the whole process: Python, torch and the process group included), the parameter bytes each rank
holds at the end, and the peak's bytes per parameter of the model.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._ranks import run_ranks, save_rank_results

GIB = 2**30


def config(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab, max_position_embeddings=256,
    )  # fmt: skip


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def build(way: str, hidden: int, layers: int, vocab: int) -> dict[str, float]:
    from lightning.fabric import Fabric
    from transformers import LlamaForCausalLM

    from lightning_zero.memory import storage_bytes

    torch.manual_seed(0)
    cfg = config(hidden, layers, vocab)
    if way == "eager":
        start = time.perf_counter()
        model = LlamaForCausalLM(cfg)
        constructed = time.perf_counter()
        set_up = constructed
    else:
        fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="zero3")
        fabric.launch()
        start = time.perf_counter()
        with fabric.init_module():
            model = LlamaForCausalLM(cfg)
        constructed = time.perf_counter()
        model = fabric.setup_module(model)
        set_up = time.perf_counter()
    params = sum(p.numel() for p in model.parameters()) if way == "eager" else 0
    return {
        "construct_s": constructed - start,
        "setup_s": set_up - constructed,
        "peak_rss": peak_rss_bytes(),
        "param_bytes": storage_bytes(model.parameters()),
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--way", choices=["eager", "zero3"], help=argparse.SUPPRESS)  # inside a rank
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way is not None:
        result = build(args.way, args.hidden, args.layers, args.vocab)
        save_rank_results(args.out_dir, int(os.environ["RANK"]), result)
        return
    sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    results = {way: run_ranks("benchmarks.bench_init", [*sizes, "--way", way], 2) for way in ("eager", "zero3")}
    params = results["eager"][0]["params"]
    print(f"Llama of {params / 1e9:.2f} B parameters ({4 * params / GIB:.1f} GiB in fp32), 2 CPU ranks")
    print("| way | construct (s) | set up (s) | peak RSS rank 0 / 1 (GiB) | parameters held per rank (GiB) "
          "| peak bytes per parameter |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for way, ranks in results.items():
        peaks = " / ".join(f"{r['peak_rss'] / GIB:.2f}" for r in ranks)
        held = ranks[0]["param_bytes"] / GIB
        per_param = max(r["peak_rss"] for r in ranks) / params
        row = f"{ranks[0]['construct_s']:.1f} | {ranks[0]['setup_s']:.1f} | {peaks} | {held:.2f} | {per_param:.2f}"
        print(f"| {way} | {row} |")


if __name__ == "__main__":
    main()
