"""The ZeRO core that both front ends drive: one mode per way of training a module (see :mod:`.mode`)."""

from lightning_zero._config import Stage, ZeroConfig
from lightning_zero._core.engine import EngineMode
from lightning_zero._core.fully_shard import FullyShardMode
from lightning_zero._core.mode import Mode
from lightning_zero._core.plain import PlainMode
from lightning_zero._core.stage3 import Stage3Mode
from lightning_zero._offload.placement import Placement

__all__ = ["EngineMode", "FullyShardMode", "Mode", "PlainMode", "Stage3Mode", "choose_mode"]


def choose_mode(config: ZeroConfig, placement: Placement, num_ranks: int, ranks_per_node: int) -> Mode:
    """The mode of a run on ``num_ranks`` ranks: on one device nothing is sharded unless the ``placement`` offloads
    (or the options ask for the sharded path there, for testing)."""
    if num_ranks == 1 and not placement.offloads and not config.sharded_on_one_device:
        return PlainMode(config, placement, ranks_per_node)
    if config.stage is Stage.PARAMETERS:  # offloaded, on `fully_shard` with its offload policy
        return FullyShardMode(config, placement, ranks_per_node) if placement.offloads else Stage3Mode(
            config, placement, ranks_per_node
        )
    return EngineMode(config, placement, ranks_per_node)
