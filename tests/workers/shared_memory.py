"""Runs inside each of N processes (started by tests/launch.py): checks the shared-memory collectives against gloo's
own and against sums computed from every rank's data, then writes the names of the checks that passed.

``python -m tests.workers.shared_memory OUT``, the payload in ``OUT`` naming the
:class:`~tests.scenarios.SharedMemoryCheck` to run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_zero._transport import collectives as comm
from lightning_zero._transport import shared_memory
from lightning_zero._transport.shm_files import PREFIX, Creator
from tests.scenarios import SharedMemoryCheck, read_payload

SIZES = [1, 7, 1000, shared_memory.SLOT_BYTES // 4 + 13, 3 * shared_memory.SLOT_BYTES // 8 + 5]  # up to 3 pieces


def data(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: the same on every process, so each can compute the expected result."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def check_open(group: dist.ProcessGroup, passed: list[str]) -> None:
    assert shared_memory.channel(group) is not None, "the ranks of one host should share memory"
    pids: list[int] = [0] * group.size()
    dist.all_gather_object(pids, os.getpid(), group=group)  # every rank has unlinked its files
    assert not leftovers(pids), f"files left in /dev/shm: {leftovers(pids)}"
    passed.append("opened, nothing left in /dev/shm")


def check_collectives(group: dist.ProcessGroup, passed: list[str]) -> None:
    size, me = group.size(), group.rank()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for seed, numel in enumerate(SIZES):
            chunks = [data(r, numel, dtype, seed) for r in range(size)]
            gathered = torch.empty(size * numel, dtype=dtype)
            comm.all_gather(gathered, chunks[me], group).wait()
            assert torch.equal(gathered, torch.cat(chunks)), f"all_gather {dtype} {numel}"

            buffers = [data(r, size * numel, dtype, seed + 100) for r in range(size)]
            output = torch.empty(numel, dtype=dtype)
            comm.reduce_scatter_sum(output, buffers[me].clone(), group).wait()
            expected = buffers[0].view(size, -1)[me].clone()
            for r in range(1, size):
                expected += buffers[r].view(size, -1)[me]  # in rank order, as the channel adds
            assert torch.equal(output, expected), f"reduce_scatter {dtype} {numel}"

            # the output may be this rank's own chunk of the buffer (stage 2 reduces in place)
            in_place = buffers[me].clone()
            own = in_place.view(size, -1)[me]
            comm.reduce_scatter_sum(own, in_place, group).wait()
            assert torch.equal(own, expected), f"reduce_scatter in place {dtype} {numel}"

            total = buffers[me].clone()
            comm.all_reduce_sum(total, group).wait()
            expected_total = buffers[0].clone()
            for r in range(1, size):
                expected_total += buffers[r]
            assert torch.equal(total, expected_total), f"all_reduce {dtype} {numel}"
            if dtype == torch.float32:  # gloo's own, another order: equal up to fp32 rounding
                reference = buffers[me].clone()
                dist.all_reduce(reference, group=group)
                torch.testing.assert_close(total, reference, rtol=1e-6, atol=1e-6)
    passed.append("all_gather, reduce_scatter, all_reduce: every dtype and size, several pieces")

    # Several collectives in flight: started together, finished in any order, each still right.
    first, second = data(me, 5000, torch.float32, 7), data(me, 3000, torch.float32, 8)
    out_first, out_second = torch.empty(size * 5000), torch.empty(size * 3000)
    pending = [comm.all_gather(out_first, first, group), comm.all_gather(out_second, second, group)]
    for work in reversed(pending):
        work.wait()
    assert torch.equal(out_first, torch.cat([data(r, 5000, torch.float32, 7) for r in range(size)]))
    assert torch.equal(out_second, torch.cat([data(r, 3000, torch.float32, 8) for r in range(size)]))
    passed.append("collectives in flight together")


def check_gather_ring(group: dist.ProcessGroup, passed: list[str]) -> None:
    size, me = group.size(), group.rank()
    channel = shared_memory.channel(group)
    assert channel is not None
    numel = 1000
    assert channel.open_gather_ring(numel * 4)
    # Ring buffers hold `numel` floats: an all-gather of `numel // size` floats per rank fits.
    per_rank = numel // size
    expected = torch.cat([data(r, per_rank, torch.float32, 3) for r in range(size)])
    held = []
    for _ in range(shared_memory.RING_SIZE):
        output = channel.gather_buffer(size * per_rank, torch.float32)
        assert output is not None
        output.view(size, -1)[me].copy_(data(me, per_rank, torch.float32, 3))
        comm.all_gather(output, output.view(size, -1)[me], group).wait()
        assert torch.equal(output, expected)
        held.append(output)
    # Every buffer is still held: the next all-gather goes through the slots, still right.
    assert channel.gather_buffer(size * per_rank, torch.float32) is None
    private = torch.empty(size * per_rank)
    comm.all_gather(private, data(me, per_rank, torch.float32, 3), group).wait()
    assert torch.equal(private, expected)
    passed.append("ring buffers handed out while free, slots when all held")

    # Rank 0 releases buffer 0, the others keep holding it: no rank may hand buffer 0 out again.
    if me == 0:
        held[0] = None  # type: ignore[call-overload]
    held[1] = None  # type: ignore[call-overload]  # everyone releases buffer 1
    comm.all_reduce_sum(torch.zeros(1), group).wait()  # a barrier carries who holds what
    reused = channel.gather_buffer(size * per_rank, torch.float32)
    assert reused is not None
    slot_size = channel._ring.buffer_bytes  # type: ignore[union-attr]
    assert reused.untyped_storage().data_ptr() != held[2].untyped_storage().data_ptr()
    index = [i for i in range(shared_memory.RING_SIZE) if channel._ring._storages[i].data_ptr()  # type: ignore[union-attr]
             == reused.untyped_storage().data_ptr()]
    assert index == [1], f"expected buffer 1 (released everywhere), got {index} of {slot_size} B buffers"
    reused.view(size, -1)[me].copy_(data(me, per_rank, torch.float32, 3))
    comm.all_gather(reused, reused.view(size, -1)[me], group).wait()
    assert torch.equal(reused, expected)
    passed.append("a buffer released on one rank only is not handed out")


def check_peer_exit(group: dist.ProcessGroup, passed: list[str]) -> None:
    chunk = torch.ones(10)
    comm.all_gather(torch.empty(10 * group.size()), chunk, group).wait()  # opens the channel on every rank
    if group.rank() == 1:
        os._exit(0)  # gone without a word, as a crashed rank would be
    started = time.monotonic()
    try:
        comm.all_gather(torch.empty(10 * group.size()), chunk, group).wait()
    except RuntimeError as error:
        assert "exited" in str(error) and "HINT" in str(error), str(error)
        assert time.monotonic() - started < 10
        passed.append("a peer that exits is reported")


def check_timeout(group: dist.ProcessGroup, passed: list[str]) -> None:
    # the channel waits as long as its group does: a group of the same ranks with a 2 s timeout
    waiting = dist.new_group(dist.get_process_group_ranks(group), timeout=timedelta(seconds=2))
    channel = shared_memory.Channel.open(waiting)
    assert channel is not None
    if group.rank() == 1:
        time.sleep(4)
    try:
        channel.all_reduce_sum(torch.ones(4)).wait()
        assert group.rank() == 1, "rank 0 should have given up after 2 s"
    except RuntimeError as error:
        assert group.rank() == 0 and "within 2 s" in str(error), str(error)
        passed.append("a rank that never arrives is reported after the timeout")
    dist.barrier()  # rank 1 completes the collective with the byte rank 0 sent before giving up
    channel.close()


def leftovers(pids: list[int]) -> list[str]:
    """Entries in /dev/shm of the processes ``pids``, or whose creator their name does not say (other runs' entries,
    of other tests running beside this one, are theirs to check)."""
    entries = [name for name in os.listdir("/dev/shm") if name.startswith(PREFIX)]
    return [name for name in entries if (creator := Creator.of(name, PREFIX)) is None or creator.pid in pids]


def check_opening_alone(group: dist.ProcessGroup, ring: bool) -> None:
    """Rank 1 never comes to the channel's opening (or, with ``ring``, the gather ring's): rank 0 creates its files
    and waits, for the test to kill it there."""
    if ring:
        assert shared_memory.channel(group) is not None
    if group.rank() == 1:
        time.sleep(120)
    channel = shared_memory.channel(group)
    if ring:
        assert channel is not None
        channel.open_gather_ring(2**20)


def main(out: Path) -> None:
    check = read_payload(out)["phase"]
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    assert group is not None
    passed: list[str] = []
    match check:
        case SharedMemoryCheck.OPEN:
            check_open(group, passed)
        case SharedMemoryCheck.COLLECTIVES:
            check_open(group, passed)
            check_collectives(group, passed)
            check_gather_ring(group, passed)
        case SharedMemoryCheck.PEER_EXIT:
            check_peer_exit(group, passed)
        case SharedMemoryCheck.TIMEOUT:
            check_timeout(group, passed)
        case SharedMemoryCheck.CHANNEL_ALONE | SharedMemoryCheck.RING_ALONE:
            check_opening_alone(group, ring=check is SharedMemoryCheck.RING_ALONE)
    (out / f"rank{group.rank()}.json").write_text(json.dumps(passed))
    sys.stdout.flush()
    os._exit(0)  # a peer may be gone: skip gloo's teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]))
