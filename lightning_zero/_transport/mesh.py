"""The ranks a run shards over and those it replicates over.

Vocabulary:

- **shard group**: the ranks that together hold one copy of the model state, each its shard. Without hybrid sharding
  it is every rank; with ``shard_group_size=k`` (or ``"node"``: the ranks of one node) it is ``k`` consecutive global
  ranks, so that a group lives on one node and its all-gathers and reduce-scatters stay on the node's links.
- **replicate group**: a rank and its counterparts (the same shard rank) in the other shard groups. Gradients reduced
  within a shard group are all-reduced across it, shard by shard: only ``1/k`` of the gradient bytes cross nodes, and
  parameter gathers never do.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_zero._transport.peers import group_timeout


@dataclass(frozen=True)
class DataParallelMesh:
    """This rank's groups."""

    shard: DeviceMesh  # 1-D, over this rank's shard group: the mesh of the DTensor shards
    replicate: ProcessGroup | None  # across the shard groups; ``None`` when one group holds every rank
    world: ProcessGroup  # every data-parallel rank: gradients average over these, rank 0's weights start everywhere

    @property
    def shard_group(self) -> ProcessGroup:
        return self.shard.get_group()

    @property
    def world_size(self) -> int:
        return self.world.size()


@dataclass(frozen=True)
class Split:
    """A shard group split into parts of consecutive ranks (the ranks of a host): ``inner``, this rank's part;
    ``across``, this rank and its counterparts (the same place in their part) in the other parts."""

    inner: ProcessGroup
    across: ProcessGroup


# Per default process group (a test may destroy and create it again), device type and shard group size: groups are
# created once, collectively, and reused by every later run of the process (each group opens its own channels).
_MESHES: dict[tuple[ProcessGroup, str, int], DataParallelMesh] = {}
# the same, per default process group, shard group size and part size
_SPLITS: dict[tuple[ProcessGroup, int, int], Split] = {}
# every mesh this package created and that still lives: those whose references to process groups it releases
_CREATED: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()


def created(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``, recorded as one this package created (see :func:`created_meshes`)."""
    _CREATED.add(mesh)
    return mesh


def created_meshes() -> list[DeviceMesh]:
    """The meshes this package created that still live."""
    return list(_CREATED)


def data_parallel_mesh(device_type: str, shard_size: int) -> DataParallelMesh:
    """Collective on first use: the mesh of shard groups of ``shard_size`` consecutive ranks. The groups wait for
    their peers as long as the default group does (the strategy's ``timeout``), where new groups would otherwise get
    torch's default of 30 minutes."""
    world = dist.group.WORLD
    assert world is not None
    key = (world, device_type, shard_size)
    forget_stale_meshes()
    if key not in _MESHES:
        world_size = world.size()
        if shard_size == world_size:
            _MESHES[key] = DataParallelMesh(created(init_device_mesh(device_type, (world_size,))), None, world)
        else:
            timeout = group_timeout(world)
            # every rank creates every group, in the same order, as `new_group` requires
            shards = [list(range(start, start + shard_size)) for start in range(0, world_size, shard_size)]
            replicas = [list(range(offset, world_size, shard_size)) for offset in range(shard_size)]
            groups = {tuple(ranks): dist.new_group(ranks, timeout=timeout) for ranks in (*shards, *replicas)}
            rank = world.rank()
            shard = groups[tuple(shards[rank // shard_size])]
            replicate = groups[tuple(replicas[rank % shard_size])]
            _MESHES[key] = DataParallelMesh(created(DeviceMesh.from_group(shard, device_type)), replicate, world)
    return _MESHES[key]


def split(shard_size: int, part_size: int) -> Split:
    """Collective on first use: this rank's shard group (of ``shard_size`` consecutive ranks) split into parts of
    ``part_size`` consecutive ranks, which must divide it."""
    world = dist.group.WORLD
    assert world is not None and shard_size % part_size == 0
    key = (world, shard_size, part_size)
    forget_stale_meshes()
    if key not in _SPLITS:
        timeout = group_timeout(world)
        inner, across = [], []
        for start in range(0, world.size(), shard_size):
            inner += [list(range(s, s + part_size)) for s in range(start, start + shard_size, part_size)]
            across += [list(range(start + o, start + shard_size, part_size)) for o in range(part_size)]
        groups = {tuple(ranks): dist.new_group(ranks, timeout=timeout) for ranks in (*inner, *across)}
        rank = world.rank()
        mine = [groups[tuple(ranks)] for ranks in (*inner, *across) if rank in ranks]
        _SPLITS[key] = Split(*mine)
    return _SPLITS[key]


def forget_stale_meshes() -> bool:
    """Drop the cached meshes of default process groups destroyed since (the default group is another one, or none);
    return whether there were any."""
    world = dist.group.WORLD if dist.is_initialized() else None
    stale = [key for key in _MESHES if key[0] is not world]
    for key in stale:
        del _MESHES[key]
    for key in [key for key in _SPLITS if key[0] is not world]:
        del _SPLITS[key]
    return bool(stale)


def forget_meshes() -> None:
    """Drop the cached meshes, and with them the references they hold to their process groups (once destroyed, a
    group lives on, with its threads, as long as anything refers to it)."""
    _MESHES.clear()
    _SPLITS.clear()


def shard_group_size(option: int | str | None, world_size: int, ranks_per_node: int) -> int:
    """The shard group size ``shard_group_size=option`` gives on ``world_size`` ranks of ``ranks_per_node`` each."""
    size = world_size if option is None else ranks_per_node if option == "node" else int(option)
    if size > world_size or world_size % size:
        raise ValueError(
            f"`shard_group_size={option!r}` makes shard groups of {size} ranks, which do not divide the {world_size}"
            " ranks of this run. HINT: pass a divisor of the number of ranks, or 'node' for one group per node."
        )
    return size
