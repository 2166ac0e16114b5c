"""A DeepSpeed config read as this package's options: what maps is taken, Trainer flags and keys not acted on are
named in one warning, what would change results is refused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

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


def test_maps_what_it_can_and_names_the_rest() -> None:
    with pytest.warns(UserWarning) as record:
        strategy = lightning_zero.ZeroStrategy.from_deepspeed_config(LIGHTNING_STYLE)
    config = strategy.config
    assert config.stage is Stage.PARAMETERS and config.master_weights and config.offload_parameters
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


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"zero_optimization": {"stage": 0}}, r"stage` is 0, which shards nothing. HINT: use `strategy=\"ddp\"`"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}, "`optimizer` is DeepSpeed's own.*HINT"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "quantizes.*HINT"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "host memory only here. HINT"),
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "one of bf16"),
    ],
)
def test_what_would_change_results_is_refused(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lightning_zero.ZeroStrategy.from_deepspeed_config(config)


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
