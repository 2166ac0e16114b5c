"""A DeepSpeed config read as this package's options: what maps is taken, Trainer flags and keys not acted on are
named in one warning, what would change results is refused."""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_zero
from lightning_zero._config import OffloadTarget, Stage
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.fixtures.deepspeed.model import FixtureModel

LIGHTNING_STYLE = {  # what Lightning's DeepSpeedStrategy(stage=3, offload_optimizer=True, ...) writes, and more
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False, "buffer_count": 4},
        "offload_param": {"device": "cpu", "pin_memory": False, "buffer_size": 1e8},
        "overlap_comm": True,
        "sub_group_size": 1e12,
        "zero_hpz_partition_size": 2,
        "stage3_prefetch_bucket_size": "auto",
    },
}


def test_zero_plus_plus_keys_map_to_its_options() -> None:
    """ZeRO++'s three keys, as DeepSpeed's tutorial sets them (the secondary copy within a node of 8), for stage 3 with
    parameters on the device; with offloaded parameters the partition size makes hybrid sharding's groups instead."""
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 8}
    config = lightning_zero.ZeroStrategy.from_deepspeed_config({"zero_optimization": zero}).config
    assert config.quantize_weights and config.quantize_gradients and config.secondary_group_size == 8
    assert config.shard_group_size is None
    offloaded = {**zero, "offload_param": {"device": "cpu"}}
    config = lightning_zero.ZeroStrategy.from_deepspeed_config({"zero_optimization": offloaded}).config
    assert config.secondary_group_size is None and config.shard_group_size == 8


def test_maps_what_it_can_and_names_the_rest() -> None:
    with pytest.warns(UserWarning) as record:
        strategy = lightning_zero.ZeroStrategy.from_deepspeed_config(LIGHTNING_STYLE)
    config = strategy.config
    assert config.stage is Stage.PARAMETERS and config.master_weights and config.offload_parameters is OffloadTarget.CPU
    assert config.offload_optimizer is OffloadTarget.CPU and not config.pin_memory and config.shard_group_size == 2
    assert len(record) == 1
    message = str(record[0].message)
    for named in ("gradient_clip_val=1.0", "precision='bf16-true'", "accumulate_grad_batches=2", "batch_size=4",
                  "zero_allow_untested_optimizer", "zero_optimization.overlap_comm", "zero_optimization.sub_group_size",
                  "offload_optimizer.buffer_count", "offload_param.buffer_size"):  # fmt: skip
        assert named in message, named
    assert "stage3_prefetch_bucket_size" not in message  # "auto" is a launcher's to fill in: not a setting


def test_buckets_nvme_and_reduce_dtype_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {"stage": 2, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e7, "offload_optimizer": offload}
    path.write_text(json.dumps({"zero_optimization": zero, "communication_data_type": "fp32", "gradient_clipping": 0}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key acted on, no clipping: no warning
        strategy = FabricZeroStrategy.from_deepspeed_config(path)
    config = strategy.config
    assert config.stage is Stage.GRADIENTS and config.bucket_cap_mb == 5e7 * 4 / 2**20
    assert config.offload_optimizer is OffloadTarget.DISK and config.offload_dir == tmp_path
    assert config.reduce_dtype == torch.float32


def test_stage_3_buckets_its_gradient_reduction_and_keeps_parameters_for_reuse() -> None:
    zero = {"stage": 3, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8, "stage3_max_reuse_distance": 1e6}
    with pytest.warns(UserWarning, match=r"allgather_bucket_size \(stage 3 gathers a unit at a time\)"):
        strategy = FabricZeroStrategy.from_deepspeed_config({"zero_optimization": zero, "gradient_clipping": 0})
    config = strategy.config
    assert config.stage is Stage.PARAMETERS and config.bucket_cap_mb == 5e7 * 4 / 2**20
    assert config.keep_for_backward_mb == 1e6 * 4 / 2**20


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"zero_optimization": {"stage": 0}}, r"stage` is 0, which shards nothing. HINT: use `strategy=\"ddp\"`"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}, "'Lamb': LAMB is not in `torch.optim`"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "OneBitAdam"}}, "compresses what ranks exchange"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}, "'auto'"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1}}}, "clip"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lrr": 1}}}, "keyword.*'lrr'"),
        ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "LRRangeTest"}}, "'LRRangeTest'. HINT: use one"),
        (
            {"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            "warmup_num_steps must be a positive integer",
        ),
        ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, "quantizes.*HINT"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/a"},
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/b"},
                }
            },
            "both go in one offload directory here. HINT: give both sections the same nvme_path",
        ),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "one of bf16"),
    ],
)
def test_what_would_change_results_is_refused(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lightning_zero.ZeroStrategy.from_deepspeed_config(config)


def test_zero_infinity(tmp_path: Path) -> None:
    """``offload_param.device="nvme"`` is ZeRO-Infinity: the shards on disk at ``nvme_path``, DeepSpeed's
    ``max_in_cpu`` parameter elements kept in memory, ``buffer_count`` buffers (one in use, the rest read ahead); the
    optimizer state follows to disk unless ``offload_optimizer`` keeps it in host memory."""
    param = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 1e6, "buffer_count": 4, "buffer_size": 1e8}
    with pytest.warns(UserWarning, match="offload_param.buffer_size"):
        config = lightning_zero.ZeroStrategy.from_deepspeed_config({"zero_optimization": {"stage": 3,
                                                                    "offload_param": param}}).config  # fmt: skip
    assert config.offload_parameters is config.offload is OffloadTarget.DISK and config.offload_dir == tmp_path
    assert config.max_in_cpu == 1_000_000 and config.prefetch_units == 3
    both = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "cpu"}}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeepSpeed's default clipping, named
        config = lightning_zero.ZeroStrategy.from_deepspeed_config({"zero_optimization": both}).config
    assert config.offload_parameters is OffloadTarget.DISK and config.offload is OffloadTarget.CPU
    assert config.max_in_cpu == 0 and config.prefetch_units == 2  # this package's defaults where none is given


def test_deepspeeds_default_clipping_is_named() -> None:
    with pytest.warns(UserWarning, match=r"set these on the Trainer .*gradient_clip_val=1.0"):
        lightning_zero.ZeroStrategy.from_deepspeed_config({"zero_optimization": {"stage": 1}})


def test_arguments_beside_it_must_agree() -> None:
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ValueError, match=r"`offload_optimizer='disk'` and a DeepSpeed config that sets it to 'cpu'"):
        lightning_zero.ZeroStrategy.from_deepspeed_config(config, offload_optimizer="disk")
    assert lightning_zero.ZeroStrategy.from_deepspeed_config(config, memory_report=False).config.memory_report is False
    with pytest.raises(ValueError, match="Zero1Strategy runs stage 1, not `stage=2`"):
        lightning_zero.Zero1Strategy.from_deepspeed_config(config)


def test_named_in_a_lightning_cli_config(tmp_path: Path) -> None:
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    cli_config = tmp_path / "config.yaml"
    cli_config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
        f"    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      deepspeed_config: {ds_config}\n"
    )
    with pytest.warns(UserWarning, match="gradient_clip_val=1.0"):  # DeepSpeed's default, named
        cli = LightningCLI(FixtureModel, run=False, args=["--config", str(cli_config)])
    assert cli.trainer.strategy.config.stage is Stage.PARAMETERS and cli.trainer.strategy.config.offload_parameters


def test_fabric_refuses_the_optimizer_and_scheduler_sections() -> None:
    """A Fabric loop builds its own optimizer: the sections are refused, with DeepSpeed's meaning of its ``Adam``."""
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0, "optimizer": {"type": "Adam"}}
    with pytest.raises(ValueError, match=r"a Fabric loop builds its own. HINT: .*`torch.optim.AdamW`"):
        FabricZeroStrategy.from_deepspeed_config(config)


# --- the optimizer and scheduler sections, as DeepSpeed builds them ---------------------------------------------------


def built(optimizer: dict | None, scheduler: dict | None = None) -> tuple[torch.optim.Optimizer, Any]:
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0}
    config |= {"optimizer": optimizer} if optimizer else {}
    config |= {"scheduler": scheduler} if scheduler else {}
    sections = lightning_zero.ZeroStrategy.from_deepspeed_config(config).config.deepspeed_optimization
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = sections.optimizer(params) if optimizer else torch.optim.SGD(params, lr=0.1)
    return opt, sections.scheduler(opt)


@pytest.mark.parametrize(
    ("section", "cls", "defaults"),
    [
        # DeepSpeed's "Adam" is FusedAdam in AdamW mode, weight decay 0 unless given
        ({"type": "Adam", "params": {"lr": 3e-4}}, torch.optim.AdamW, {"lr": 3e-4, "weight_decay": 0.0}),
        ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, torch.optim.Adam, {"lr": 1e-3}),
        ({"type": "AdamW", "params": {"betas": [0.8, 0.9], "eps": 1e-6}}, torch.optim.AdamW, {"eps": 1e-6}),
        # `torch_adam` hands the parameters to torch as they are: torch's AdamW decays by 0.01
        ({"type": "AdamW", "params": {"torch_adam": True}}, torch.optim.AdamW, {"weight_decay": 0.01}),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD, {"momentum": 0.9}),
        ({"type": "Adagrad", "params": {"lr": 0.1}}, torch.optim.Adagrad, {"lr": 0.1}),
    ],
)
def test_the_optimizer_section_builds_what_deepspeed_builds(section: dict, cls: type, defaults: dict) -> None:
    optimizer, scheduler = built(section)
    assert type(optimizer) is cls and scheduler is None
    for key, value in defaults.items():
        assert optimizer.defaults[key] == value, key


def lrs_per_step(scheduler: Any, steps: int) -> list[float]:
    """The learning rate each of ``steps`` optimizer steps runs at, the scheduler stepped after each (as DeepSpeed's
    engine and Lightning's ``interval="step"`` both do)."""
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


# DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py), by the iteration i = step - 1 that step `step` runs at
# (i = -1 for the first step, before the scheduler has stepped): written out here from DeepSpeed's definitions.


def warmup(i: int, low: float, high: float, steps: int, kind: str) -> float:
    steps = max(2, steps)
    if i < 0:
        return low
    if i >= steps:
        return high
    gamma = math.log(i + 1) / math.log(steps) if kind == "log" else i / steps
    return low + (high - low) * gamma


def warmup_decay(i: int, low: float, high: float, steps: int, kind: str, total: int) -> float:
    if i < max(2, steps):
        return warmup(i, low, high, steps, kind)
    return low + (high - low) * max(0.0, (total - i) / max(1.0, total - max(2, steps)))


def warmup_cosine(i: int, lr: float, min_ratio: float, steps: int, cos_min: float, total: int, kind: str) -> float:
    if i < 0:
        return 0.0
    if i < steps:
        return lr * (min_ratio + (1 - min_ratio) * warmup(i, 0.0, 1.0, steps, kind))
    progress = min(1.0, (i - steps + 1) / max(1, total - steps))
    return lr * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle(i: int, low: float, high: float, up: int, down: int, decay_rate: float, decay_every: int) -> float:
    if i < 0:
        return low
    if i < up + down:  # a triangle: up over `up` iterations, counted from i + 1, then down
        at = i + 1
        x = 1 + at / (up + down) - math.floor(1 + at / (up + down))
        ratio = up / (up + down)
        return low + (high - low) * (x / ratio if x <= ratio else (x - 1) / (ratio - 1))
    return low / (1 + decay_rate * (i - (up + down) + 1) / decay_every)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_schedules_follow_deepspeeds_formulas(kind: str) -> None:
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5, "warmup_type": kind}
    _, scheduler = built(None, {"type": "WarmupLR", "params": params})
    assert lrs_per_step(scheduler, 9) == pytest.approx([warmup(s - 1, 0.01, 0.1, 5, kind) for s in range(9)])
    _, scheduler = built(None, {"type": "WarmupDecayLR", "params": {**params, "total_num_steps": 10}})
    expected = [warmup_decay(s - 1, 0.01, 0.1, 5, kind, 10) for s in range(13)]
    assert lrs_per_step(scheduler, 13) == pytest.approx(expected)
    assert expected[-1] == 0.01 and max(expected) == pytest.approx(0.1)  # down to warmup_min_lr, past the end too
    cosine = {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.01}
    _, scheduler = built({"type": "SGD", "params": {"lr": 0.2}}, {"type": "WarmupCosineLR", "params": cosine})
    expected = [warmup_cosine(s - 1, 0.2, 0.1, 4, 0.01, 10, "log") for s in range(13)]
    assert lrs_per_step(scheduler, 13) == pytest.approx(expected)


def test_warmup_lr_reaches_the_optimizers_lr_by_default() -> None:
    _, scheduler = built(
        {"type": "SGD", "params": {"lr": 0.3}}, {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    )
    assert lrs_per_step(scheduler, 5) == pytest.approx([warmup(s - 1, 0.0, 0.3, 3, "log") for s in range(5)])


def test_one_cycle_follows_deepspeeds_formula_with_its_momentum() -> None:
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_second_step_size": 2,
              "decay_lr_rate": 0.5, "decay_step_size": 2, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}  # fmt: skip
    optimizer, scheduler = built({"type": "Adam", "params": {"lr": 0.5}}, {"type": "OneCycle", "params": params})
    betas = []
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        betas.append(optimizer.param_groups[0]["betas"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([one_cycle(s - 1, 0.01, 0.1, 4, 2, 0.5, 2) for s in range(12)])
    assert max(lrs) == pytest.approx(0.1)
    # momentum runs against the learning rate, from cycle_max_mom down to cycle_min_mom; DeepSpeed's beta2 is 0.99
    expected_momentum = [0.85] + [0.95 - (0.95 - 0.85) * (lr - 0.01) / 0.09 for lr in lrs[1:6]] + [0.95] * 6
    assert [b[0] for b in betas] == pytest.approx(expected_momentum)
    assert {b[1] for b in betas} == {0.99}


def test_a_schedule_is_saved_and_resumed_as_torchs_are() -> None:
    """Its state is numbers only (a checkpoint loads it with ``weights_only=True``) and resumes at the same step."""
    params = {"warmup_num_steps": 4, "total_num_steps": 8, "warmup_max_lr": 0.1}
    _, scheduler = built(None, {"type": "WarmupDecayLR", "params": params})
    lrs_per_step(scheduler, 3)
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    _, resumed = built(None, {"type": "WarmupDecayLR", "params": params})
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed.optimizer.param_groups[0]["lr"] = scheduler.optimizer.param_groups[0]["lr"]  # restored with the optimizer
    assert lrs_per_step(resumed, 5) == pytest.approx(lrs_per_step(scheduler, 5))


def test_a_config_path_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"missing.json cannot be read: .*HINT: pass the path of DeepSpeed's JSON"):
        lightning_zero.ZeroStrategy.from_deepspeed_config(tmp_path / "missing.json")
