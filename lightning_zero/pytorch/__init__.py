"""The Trainer front end: ZeRO as ``lightning.pytorch`` strategies."""

from lightning_zero.pytorch.strategy import Zero1Strategy, Zero2Strategy, Zero3Strategy, ZeroStrategy

__all__ = ["Zero1Strategy", "Zero2Strategy", "Zero3Strategy", "ZeroStrategy"]
