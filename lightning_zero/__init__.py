"""ZeRO (the Zero Redundancy Optimizer) as PyTorch Lightning strategies, for the Trainer and for Fabric.

``import lightning_zero`` registers the strategy names ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"zero2_offload"``,
``"zero3_offload"``, ``"zero3_infinity"`` and ``"zero_auto"`` (the stage and offload that fit, chosen at set-up) with
both, so ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")`` work; the classes
(``lightning_zero.Zero3Strategy`` for the Trainer, ``lightning_zero.fabric.Zero3Strategy`` for Fabric) can also be
passed directly or named as ``class_path`` in a LightningCLI config.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import _versions, fabric  # noqa: F401 (`_versions` first: it refuses too old a torch or Lightning)
from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero._offload.target import OffloadError
from lightning_zero.consolidate import consolidate_checkpoint, whole_state_dict
from lightning_zero.pytorch.auto import ZeroAutoStrategy
from lightning_zero.pytorch.strategy import Zero1Strategy, Zero2Strategy, Zero3Strategy, ZeroStrategy

__all__ = [
    "CheckpointError",
    "OffloadError",
    "Zero1Strategy",
    "Zero2Strategy",
    "Zero3Strategy",
    "ZeroAutoStrategy",
    "ZeroStrategy",
    "consolidate_checkpoint",
    "fabric",
    "whole_state_dict",
]
__version__ = "0.1.0"

ZeroStrategy.register_strategies(StrategyRegistry)
fabric.ZeroStrategy.register_strategies(FABRIC_STRATEGIES)
ZeroAutoStrategy.register_strategies(StrategyRegistry)
fabric.ZeroAutoStrategy.register_strategies(FABRIC_STRATEGIES)
