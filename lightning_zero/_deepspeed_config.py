"""A DeepSpeed config (JSON file or dict) read as this package's options: ``ZeroStrategy.from_deepspeed_config`` and
the strategies' ``deepspeed_config`` argument.

What maps to a ZeRO option is taken; DeepSpeed's ``optimizer`` and ``scheduler`` sections become the torch objects
that compute the same (:mod:`lightning_zero._deepspeed_optim`); what is a Trainer flag (precision, clipping,
accumulation) is named in a warning with the flag to set, together with every key not acted on; a key whose absence
here would change what training computes (stage 0, quantized non-trainable weights) is refused. ZeRO++'s keys map to
``quantize_weights``, ``quantize_gradients`` and ``secondary_group_size`` (hybrid sharding's ``shard_group_size``
where the parameters are offloaded, which the secondary copy is not).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_zero._deepspeed_optim import DeepSpeedOptimization

_REFUSED_ZERO = ("zero_quantized_nontrainable_weights",)
_ZERO_PLUS_PLUS = {"zero_quantized_weights": "quantize_weights", "zero_quantized_gradients": "quantize_gradients"}
_DEFAULT_CLIPPING = 1.0
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16"}


def read_deepspeed_config(config: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a dict, and how to name it in messages."""
    if isinstance(config, Mapping):
        return dict(config), "the DeepSpeed config"
    path = Path(config)
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"DeepSpeed config {path} cannot be read: {error}. HINT: pass the path of DeepSpeed's JSON config, or"
            " the config as a dict."
        ) from error
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config {path} holds a {type(loaded).__name__}, not a JSON object.")
    return loaded, f"DeepSpeed config {path}"


def deepspeed_options(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The ZeRO options ``config`` asks for (by this package's option names, ``stage`` among them); warns once naming
    the Trainer flags it asks for and the keys not acted on."""
    values, source = read_deepspeed_config(config)
    reader = _Reader(source)
    options = reader.zero(_given(values.pop("zero_optimization", {})))
    optimizer, scheduler = values.pop("optimizer", None), values.pop("scheduler", None)
    if optimizer is not None or scheduler is not None:
        options["deepspeed_optimization"] = DeepSpeedOptimization.read(optimizer, scheduler, source)
    given = _given(values)
    # DeepSpeed (0.19.8) clips at a global norm of 1.0 where the config says nothing
    given.setdefault("gradient_clipping", _DEFAULT_CLIPPING)
    for key, value in given.items():
        reader.top(key, value, options)
    # DeepSpeed counts elements of the module's dtype; this package MiB
    for elements, mib in (("bucket_elements", "bucket_cap_mb"), ("reuse_elements", "keep_for_backward_mb")):
        if elements in options:
            options[mib] = options.pop(elements) * reader.element_bytes / 2**20
    reader.warn()
    return options


def _given(section: Any) -> dict[str, Any]:
    """A section's keys, less those left to a launcher to fill in (``"auto"``)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"A DeepSpeed config section must be a JSON object, got {section!r}.")
    return {k: v for k, v in section.items() if v != "auto"}


class _Reader:
    """What one config asks for, key by key: options taken, Trainer flags to set, keys not acted on."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.flags: dict[str, Any] = {}
        self.ignored: list[str] = []
        self.element_bytes = 4
        self.batch_size: int | None = None

    def refuse(self, key: str, why: str, hint: str) -> None:
        raise ValueError(f"{self.source}: `{key}` {why}. HINT: {hint}.")

    def zero(self, zero: dict[str, Any]) -> dict[str, Any]:
        stage = zero.pop("stage", 0)
        if stage not in (1, 2, 3):
            self.refuse(
                "zero_optimization.stage", f"is {stage!r}, which shards nothing", 'use `strategy="ddp"`, or stage 1-3'
            )
        options: dict[str, Any] = {"stage": stage}
        # in MiB once the element size is known (see top); stage 3 gathers a unit at a time, and buckets only the
        # gradient reduction of small units
        buckets = {k: zero.pop(k) for k in ("reduce_bucket_size", "allgather_bucket_size") if k in zero}
        if stage == 3 and "allgather_bucket_size" in buckets:
            self.ignored.append("zero_optimization.allgather_bucket_size (stage 3 gathers a unit at a time)")
            del buckets["allgather_bucket_size"]
        if buckets:
            options["bucket_elements"] = max(buckets.values())
        if zero.pop("cpu_offload", False):
            options["offload_optimizer"] = "cpu"
        self.offload_optimizer(_given(zero.pop("offload_optimizer", {})), options)
        self.offload_param(_given(zero.pop("offload_param", {})), options)
        if stage == 3 and "stage3_max_reuse_distance" in zero:  # parameters kept from forward to backward
            options["reuse_elements"] = zero.pop("stage3_max_reuse_distance")
        hpz = zero.pop("zero_hpz_partition_size", 1)
        if hpz != 1:
            offloaded = options.get("offload_parameters", False) is not False
            options["secondary_group_size" if stage == 3 and not offloaded else "shard_group_size"] = hpz
        for key, option in _ZERO_PLUS_PLUS.items():
            if zero.pop(key, False):
                options[option] = True
        for key, value in zero.items():
            if key in _REFUSED_ZERO and value:
                self.refuse(f"zero_optimization.{key}", "quantizes frozen weights", "drop it")
            self.ignored.append(f"zero_optimization.{key}")
        return options

    def offload_optimizer(self, section: dict[str, Any], options: dict[str, Any]) -> None:
        device = section.pop("device", "none")
        if device == "cpu":
            options["offload_optimizer"] = "cpu"
        elif device == "nvme":
            options["offload_optimizer"] = "disk"
            options["offload_dir"] = section.pop("nvme_path", None)
        section.pop("nvme_path", None)
        if "pin_memory" in section:
            options["pin_memory"] = bool(section.pop("pin_memory"))
        self.ignored += [f"zero_optimization.offload_optimizer.{k}" for k in section]

    def offload_param(self, section: dict[str, Any], options: dict[str, Any]) -> None:
        device = section.pop("device", "none")
        if device == "cpu":
            options["offload_parameters"] = True
        elif device == "nvme":
            options["offload_parameters"] = "disk"
            path = section.pop("nvme_path", None)
            if options.get("offload_dir") not in (None, path):
                self.refuse(
                    "zero_optimization.offload_param.nvme_path",
                    f"is {path!r} and offload_optimizer's nvme_path {options['offload_dir']!r}; both go in one"
                    " offload directory here",
                    "give both sections the same nvme_path",
                )
            options["offload_dir"] = path
            if "max_in_cpu" in section:  # parameter elements, as here
                options["max_in_cpu"] = int(section.pop("max_in_cpu"))
            if "buffer_count" in section:  # the buffer in use and those read ahead
                options["prefetch_units"] = max(int(section.pop("buffer_count")) - 1, 0)
        section.pop("nvme_path", None)
        if "pin_memory" in section:
            options["pin_memory"] = bool(section.pop("pin_memory"))
        self.ignored += [f"zero_optimization.offload_param.{k}" for k in section]

    def top(self, key: str, value: Any, options: dict[str, Any]) -> None:
        match key:
            case "bf16" | "fp16":
                self.precision(key, _given(value), options)
            case "gradient_clipping":
                if value:
                    self.flags["gradient_clip_val"] = value
            case "train_micro_batch_size_per_gpu":
                self.batch_size = value
            case "gradient_accumulation_steps":
                if value != 1:
                    self.flags["accumulate_grad_batches"] = value
            case "communication_data_type":
                self.reduce_dtype(key, value, options)
            case "data_types":
                section = _given(value)
                if "grad_accum_dtype" in section:
                    self.reduce_dtype("data_types.grad_accum_dtype", section.pop("grad_accum_dtype"), options)
                self.ignored += [f"data_types.{k}" for k in section]
            case _:
                self.ignored.append(key)

    def precision(self, key: str, section: dict[str, Any], options: dict[str, Any]) -> None:
        enabled = section.pop("enabled", False)
        if enabled:
            if "precision" in self.flags:
                self.refuse(key, "is enabled beside the other 16-bit format", "enable one of bf16 and fp16")
            self.flags["precision"] = "bf16-true" if key == "bf16" else "16-true"
            options["master_weights"] = True
            self.element_bytes = 2
        self.ignored += [f"{key}.{k}" for k in section]

    def reduce_dtype(self, key: str, value: Any, options: dict[str, Any]) -> None:
        if value not in _DTYPES:
            self.refuse(key, f"is {value!r}", f"use one of {sorted(_DTYPES)}")
        if options["stage"] == 1:
            self.ignored.append(f"{key} (stage 1 reduces in the parameters' dtype)")
        else:
            options["reduce_dtype"] = _DTYPES[value]

    def warn(self) -> None:
        parts = []
        if self.flags:
            flags = ", ".join(f"{k}={v!r}" for k, v in self.flags.items())
            parts.append(f"set these on the Trainer (Fabric: `precision=` and your own loop): {flags}")
        if self.batch_size is not None:
            parts.append(f"give each rank's DataLoader `batch_size={self.batch_size}`")
        if self.ignored:
            parts.append(f"not acted on: {', '.join(self.ignored)}")
        if parts:
            warnings.warn(f"{self.source}: " + "; ".join(parts) + ".", stacklevel=6)
