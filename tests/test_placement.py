"""The placement policy (``_offload/placement.py``) on its own: where each target puts masters, which kernels and
process group it asks for, stage 3's offload policy, and disk state moved into files after a step. No processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_zero._offload.placement import OnDevice, OnDisk, OnHost, placement_for
from lightning_zero._offload.target import OffloadTarget


def test_each_target_has_its_placement(tmp_path: Path) -> None:
    assert type(placement_for(OffloadTarget.DEVICE, offload_dir=None, pin_memory=True)) is OnDevice
    assert type(placement_for(OffloadTarget.CPU, offload_dir=None, pin_memory=True)) is OnHost
    disk = placement_for(OffloadTarget.DISK, offload_dir=tmp_path, pin_memory=False)
    assert type(disk) is OnDisk and disk.directory == tmp_path and not disk.pin_memory
    assert [p.offloads for p in (OnDevice(), OnHost(), disk)] == [False, True, True]
    assert [p.state_on_device for p in (OnDevice(), OnHost(), disk)] == [True, False, False]


def test_masters_are_copies_only_where_the_optimizer_steps_elsewhere() -> None:
    """On the device a master is the shard itself unless the master dtype differs; on the host every master is a
    copy (same values), even in the shard's own dtype."""
    shards = [torch.randn(3, 2), torch.randn(4).bfloat16()]
    on_device = OnDevice().masters(shards, None)
    assert all(m is s for m, s in zip(on_device, shards, strict=True))
    fp32 = OnDevice().masters(shards, torch.float32)
    assert fp32[0] is shards[0] and fp32[1].dtype == torch.float32 and torch.equal(fp32[1], shards[1].float())
    host = OnHost().masters(shards, None)
    for master, shard in zip(host, shards, strict=True):
        assert master is not shard and master.dtype == shard.dtype and torch.equal(master, shard)
        assert master.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()


def test_process_group_and_stage3_policy() -> None:
    assert OnDevice().process_group_backend(None, "cuda") is None
    assert OnHost().process_group_backend(None, "cpu") is None  # gloo already carries host tensors
    assert OnHost().process_group_backend(None, "cuda") == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match=r"process_group_backend='nccl'.*HINT"):
        OnHost().process_group_backend("nccl", "cuda")
    assert OnDevice().fsdp_offload_policy(torch.device("cpu")) is None
    policy = OnHost(pin_memory=True).fsdp_offload_policy(torch.device("cpu"))
    assert isinstance(policy, CPUOffloadPolicy) and not policy.pin_memory  # nothing to pin for on a CPU module


def test_host_steps_use_fused_kernels_and_stage3_keeps_them_for_its_steps() -> None:
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    adam = torch.optim.Adam(params)
    assert OnDevice().shard_kernels(adam).key == "foreach"
    assert OnHost().shard_kernels(adam).key == "fused"
    assert OnHost().shard_kernels(torch.optim.SGD(params, lr=0.1)).key == "foreach"
    host = OnHost()
    host.keep_step_kernels(adam)
    seen = []
    with host.stepping(adam):
        seen.append(adam.param_groups[0]["fused"])
    assert seen == [True] and not adam.param_groups[0]["fused"]  # set for the step only
    device = OnDevice()
    device.keep_step_kernels(adam)
    with device.stepping(adam):
        assert not adam.param_groups[0]["fused"]


def test_disk_state_moves_into_files_after_each_step(tmp_path: Path) -> None:
    """The state a step creates moves into memory-mapped files as the step ends, values unchanged; later steps update
    it there in place; the step counter stays in memory; nothing is named in the directory."""
    param = torch.nn.Parameter(torch.randn(64))
    adam = torch.optim.Adam([param])
    disk = OnDisk(tmp_path)
    param.grad = torch.ones_like(param)
    with disk.stepping(adam):
        adam.step()
        state = adam.state[param]
        in_memory = {k: (state[k].data_ptr(), state[k].clone()) for k in ("exp_avg", "exp_avg_sq")}
    for key, (pointer, values) in in_memory.items():
        assert state[key].data_ptr() != pointer and torch.equal(state[key], values)
    in_files = state["exp_avg"].data_ptr()
    with disk.stepping(adam):
        adam.step()
    assert state["exp_avg"].data_ptr() == in_files and not torch.equal(state["exp_avg"], in_memory["exp_avg"][1])
    assert state["step"].dim() == 0 and list(tmp_path.iterdir()) == []
    disk.teardown()
