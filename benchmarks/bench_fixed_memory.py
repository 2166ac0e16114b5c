"""Memory a rank holds that does not grow with the model: the intercept of bytes held against parameter count.

Run from the repository root: ``python -m benchmarks.bench_fixed_memory [--layers 2 8] [--strategies ...]``.

Lightning's demo Transformer (``lightning.pytorch.demos.Transformer``, d_model 512, 8 heads, feed-forward 2048, a
33,278-token vocabulary) is trained at two depths with fp32 AdamW on random tokens by 2 CPU processes under each
strategy. Right after the second optimizer step (so every buffer a step uses has been created and reused once),
every rank walks all live tensors of its process (``gc``, deduplicated by storage; shared-memory segments mapped from
``/dev/shm`` count, since they are tensors over the mapping) and sorts their bytes into model state (parameters,
gradients, masters, optimizer state, as ``lightning_zero.memory.measure`` counts them), the communication buffers the
strategy retains between steps, and the rest. Two depths give two points per strategy: the slope is bytes per added
parameter (the ZeRO formulas: 16 for DDP, 12, 10 and 8 for stages 1, 2 and 3 on 2 ranks), the intercept what the run
holds whatever the model's size.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.demos import Transformer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategy names)
from benchmarks import _charts
from benchmarks._ranks import run_ranks, save_rank_results
from lightning_zero.memory import engine_of, measure

MIB = 2**20
VOCAB, SEQUENCE, BATCH = 33_278, 32, 2


class DemoLM(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=512, nhead=8, nhid=2048, nlayers=layers, dropout=0.0)
        self.held: dict[str, int] | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        logits = self.model(tokens, target)
        return torch.nn.functional.nll_loss(logits, target.reshape(-1))

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if batch_idx == 1:
            self.held = held_bytes(self.trainer, self)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        n = 2 * BATCH * self.trainer.world_size
        tokens = torch.randint(0, VOCAB, (n, SEQUENCE), generator=gen)
        return DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=BATCH)


def live_storages() -> dict[int, int]:
    """Bytes of every distinct storage behind a live tensor of this process."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
            continue
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        storage = local.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def held_bytes(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, int]:
    gc.collect()
    total = sum(live_storages().values())
    state = measure(module, trainer.optimizers, engine_of(trainer.strategy))
    engine = engine_of(trainer.strategy)
    pool = engine.pool.nbytes() if engine is not None else 0
    return {"total": total, "model_state": state.total, "pool": pool}


def worker(args: argparse.Namespace) -> None:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = {}
    for strategy in args.strategies:
        for layers in args.layers:
            pl.seed_everything(0, verbose=False)
            module = DemoLM(layers)
            trainer = pl.Trainer(
                accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module)
            psi = sum(p.numel() for p in DemoLM(layers).parameters())
            results[f"{strategy}/{layers}"] = {"psi": psi, **(module.held or {})}
    save_rank_results(args.out_dir, rank, results)
    dist.barrier()


def points(ranks: list[dict[str, dict[str, int]]], strategy: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """What the rank holding the most holds at each of the two depths."""
    small, large = args.layers
    a, b = (max((r[f"{strategy}/{n}"] for r in ranks), key=lambda x: x["total"]) for n in (small, large))
    return a, b


def report(ranks: list[dict[str, dict[str, int]]], args: argparse.Namespace) -> list[str]:
    """Per strategy: the rank holding the most at each depth, and the line through the two points."""
    lines = [
        "| strategy | Psi | held MiB | model state MiB | retained comm buffers MiB | other MiB | bytes per added"
        " parameter | intercept MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for strategy in args.strategies:
        a, b = points(ranks, strategy, args)
        slope = (b["total"] - a["total"]) / (b["psi"] - a["psi"])
        intercept = a["total"] - slope * a["psi"]
        for point, fit in ((a, f"{slope:.2f} | {intercept / MIB:.1f}"), (b, " | ")):
            other = point["total"] - point["model_state"] - point["pool"]
            lines.append(
                f"| {strategy} | {point['psi'] / 1e6:.1f} M | {point['total'] / MIB:.1f}"
                f" | {point['model_state'] / MIB:.1f} | {point['pool'] / MIB:.1f} | {other / MIB:.1f} | {fit} |"
            )
    return lines


def chart(ranks: list[dict[str, dict[str, int]]], args: argparse.Namespace) -> None:
    """MiB held against Psi: each strategy's two measured points, and their line drawn back to its intercept."""
    plt = _charts.pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for strategy in args.strategies:
        a, b = points(ranks, strategy, args)
        slope = (b["total"] - a["total"]) / (b["psi"] - a["psi"])
        intercept = a["total"] - slope * a["psi"]
        xs = [0, a["psi"] / 1e6, b["psi"] / 1e6]
        axes.plot(xs, [intercept / MIB, a["total"] / MIB, b["total"] / MIB], "--", color=_charts.color(strategy))
        axes.plot(xs[1:], [a["total"] / MIB, b["total"] / MIB], "o-", color=_charts.color(strategy),
                  label=f"{strategy}: {slope:.2f} B per parameter + {intercept / MIB:.0f} MiB")  # fmt: skip
    axes.set(xlabel="Psi (millions of parameters)", ylabel="MiB held per rank (largest rank)", xlim=(0, None),
             ylim=(0, None), title="What a rank holds against the model's size: slope and intercept")  # fmt: skip
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    _charts.save(figure, args.chart, f"{_charts.cpu()} (2 CPU ranks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 8], help="the two depths (encoder and decoder)")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    _charts.add_chart_argument(parser, "fixed_memory")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    argv = ["--layers", *map(str, args.layers), "--strategies", *args.strategies]
    ranks = run_ranks("benchmarks.bench_fixed_memory", argv, 2, timeout=3000)
    print("\n".join(report(ranks, args)), flush=True)
    chart(ranks, args)


if __name__ == "__main__":
    main()
