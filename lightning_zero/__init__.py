"""ZeRO (the Zero Redundancy Optimizer) as PyTorch Lightning strategies.

``import lightning_zero`` registers the strategy names ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"zero2_offload"`` and
``"zero3_offload"``, so
``Trainer(strategy="zero3")`` works; the classes can also be passed directly or named as ``class_path`` in a
LightningCLI config.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero._checkpoint.directory import CheckpointError
from lightning_zero._offload.target import OffloadError
from lightning_zero.consolidate import consolidate_checkpoint
from lightning_zero.pytorch.strategy import Zero1Strategy, Zero2Strategy, Zero3Strategy, ZeroStrategy

__all__ = [
    "CheckpointError",
    "OffloadError",
    "Zero1Strategy",
    "Zero2Strategy",
    "Zero3Strategy",
    "ZeroStrategy",
    "consolidate_checkpoint",
]
__version__ = "0.1.0"

ZeroStrategy.register_strategies(StrategyRegistry)
