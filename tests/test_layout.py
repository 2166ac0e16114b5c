"""``_engine/layout.py`` on its own: the row split against ``torch.chunk`` (what a DTensor ``Shard(0)`` and
``fully_shard`` do), and the bucket layouts as round trips of every parameter's values. No processes."""

from __future__ import annotations

import pytest
import torch

from lightning_zero._engine.layout import NaturalLayout, RankMajorLayout, ShardSpec

SHAPES = [(10, 3), (7,), (1, 4), (3, 2, 2), (2,), (0, 5), ()]
WORLD_SIZES = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_each_rank_owns_its_torch_chunk(shape: tuple[int, ...], world_size: int) -> None:
    """Rank ``r`` owns ``torch.chunk(full, N)[r]`` (nothing where chunk returns fewer pieces); a 0-dim parameter is
    whole everywhere. The view shares the parameter's storage, and the ranks' rows add up to the parameter."""
    full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()]
    full = full.reshape(shape)
    spec = ShardSpec(torch.Size(shape), world_size)
    pieces = torch.chunk(full, world_size) if full.dim() else None
    taken = []
    for rank in range(world_size):
        mine = spec.take(full, rank)
        assert mine.shape == spec.local_shape(rank) and mine.numel() == spec.local_numel(rank)
        if pieces is None:
            assert mine is full
            continue
        expected = pieces[rank] if rank < len(pieces) else full[:0]
        assert torch.equal(mine, expected)
        if mine.numel():
            assert mine.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        taken.append(mine)
    if pieces is not None:
        assert torch.equal(torch.cat(taken), full)
        assert spec.padded_rows >= full.shape[0] and spec.padded_rows % world_size == 0
        assert spec.padded_rows - full.shape[0] < world_size  # padding never fills a whole round of ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_rank_major_layout_round_trips_every_shard(world_size: int) -> None:
    """Writing every rank's shard of every parameter into its region, chunk by chunk, and reading the regions back in
    rank order rebuilds each parameter; regions never overlap each other or the presence flags."""
    params = [torch.randn(shape) if shape else torch.randn(()) for shape in [(5, 3), (4,), (), (1, 2), (9,)]]
    specs = [ShardSpec(p.shape, world_size) for p in params]
    layout = RankMajorLayout(specs, world_size)
    buffer = torch.full((layout.numel,), float("nan"))
    chunks = layout.chunks(buffer)
    assert chunks.shape == (world_size, layout.chunk_numel)
    for rank in range(world_size):
        for index, (param, spec) in enumerate(zip(params, specs, strict=True)):
            layout.region(chunks[rank], index, rank).copy_(spec.take(param, rank))
        layout.flags(chunks[rank]).fill_(1)
    for index, (param, spec) in enumerate(zip(params, specs, strict=True)):
        parts = [layout.region(chunks[rank], index, rank) for rank in range(world_size)]
        rebuilt = parts[0] if spec.replicated else torch.cat(parts)
        assert torch.equal(rebuilt, param)
    # what was never written is the padding: exactly each parameter's padded rows beyond its own
    written = (~buffer.isnan()).sum().item()
    expected = world_size * len(params) + sum(
        spec.local_numel(rank) for spec in specs for rank in range(world_size)
    )
    assert written == expected
    assert layout.flags_offset == sum(spec.padded_numel for spec in specs)


def test_natural_layout_round_trips_whole_parameters() -> None:
    shapes = [torch.Size(s) for s in [(2, 3), (4,), (), (1, 1)]]
    params = [torch.randn(shape) for shape in shapes]
    layout = NaturalLayout(shapes)
    buffer = torch.zeros(layout.numel)
    for index, param in enumerate(params):
        layout.region(buffer, index).copy_(param)
    layout.flags(buffer).fill_(1)
    assert layout.numel == sum(p.numel() for p in params) + len(params)
    for index, param in enumerate(params):
        assert torch.equal(layout.region(buffer, index), param)
    assert torch.equal(layout.flags(buffer), torch.ones(len(params)))
