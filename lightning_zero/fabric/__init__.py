"""The Fabric front end: ZeRO as ``lightning.fabric`` strategies (``Fabric(strategy="zero2")`` after
``import lightning_zero``, or these classes with options)."""

from lightning_zero.fabric.auto import ZeroAutoStrategy
from lightning_zero.fabric.strategy import Zero1Strategy, Zero2Strategy, Zero3Strategy, ZeroStrategy

__all__ = ["Zero1Strategy", "Zero2Strategy", "Zero3Strategy", "ZeroAutoStrategy", "ZeroStrategy"]
