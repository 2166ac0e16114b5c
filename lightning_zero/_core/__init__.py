"""The ZeRO core that both front ends drive: one mode per way of training a module (see :mod:`.mode`)."""

from lightning_zero._config import Stage, ZeroConfig
from lightning_zero._core.engine import EngineMode
from lightning_zero._core.fully_shard import FullyShardMode
from lightning_zero._core.mode import Mode
from lightning_zero._core.plain import PlainMode
from lightning_zero._offload.target import OffloadTarget

__all__ = ["EngineMode", "FullyShardMode", "Mode", "PlainMode", "choose_mode"]


def choose_mode(config: ZeroConfig, num_ranks: int, ranks_per_node: int) -> Mode:
    """The mode of a run on ``num_ranks`` ranks: on one device nothing is sharded unless it offloads (or the options
    ask for the sharded path there, for testing)."""
    if num_ranks == 1 and config.offload is OffloadTarget.DEVICE and not config.sharded_on_one_device:
        return PlainMode(config, ranks_per_node)
    if config.stage is Stage.PARAMETERS:
        return FullyShardMode(config, ranks_per_node)
    return EngineMode(config, ranks_per_node)
