"""Worker: shared-memory collectives against gloo's on the same inputs; rank 0 writes JSON.

usage: shm.py OUT [dead]   (dead: the last rank exits while the others wait on it)
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from hybrid2d.parallel import sequence_comm, shm_comm
from hybrid2d.parallel.shm_comm import ShmAllGather, ShmReduceScatter


def gloo_gather(x, dim, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def gloo_reduce_scatter(y, dim, group):
    n, r = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
    total = y.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(n, dim)[r]


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    transport = shm_comm.enable(group, 64 * 1024, timeout_s=3)
    if sys.argv[2:] == ["dead"]:
        return dead_peer(out, rank, world, transport)
    report = {"checked": 0, "max_error": 0.0}

    def check(got, want, exact):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        if exact:
            assert torch.equal(got, want)
        else:
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
            report["max_error"] = max(report["max_error"], err)
            assert err < 1e-6, err
        report["checked"] += 1

    gen = torch.Generator().manual_seed(1234 + rank)
    for it in range(40):  # many generations: both slots are reused over and over
        b, s, d = 1 + it % 3, world * (1 + it % 4), 8 + it % 5
        x = torch.randn(b, s, d, generator=gen)
        dtype = torch.bfloat16 if it % 5 == 0 else torch.float32
        shard = x[:, : s // world].to(dtype)
        check(sequence_comm._gather(shard, group), gloo_gather(shard, 1, group), exact=True)
        check(sequence_comm._reduce_scatter(x, group), gloo_reduce_scatter(x, 1, group), False)
        flat = x.flatten()
        want = flat.clone()
        dist.all_reduce(want, op=dist.ReduceOp.MAX, group=group)
        check(sequence_comm.all_reduce(flat, "max", group), want, exact=True)
        want = flat.clone()
        dist.all_reduce(want, group=group)
        check(sequence_comm.all_reduce(flat, "sum", group), want, exact=False)
        # FSDP2's flat hooks: all-gather into a buffer, reduce-scatter with sum and average.
        flat = flat[: (flat.numel() // world) * world]
        mine = flat[: flat.numel() // world].contiguous()
        got = torch.empty(flat.numel() // world * world)
        assert ShmAllGather()(got, mine, group) is None
        check(got, gloo_gather(mine, 0, group), exact=True)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            got = torch.empty(flat.numel() // world)
            ShmReduceScatter()(got, flat, group, op)
            want = gloo_reduce_scatter(flat, 0, group)
            check(got, want / world if op == dist.ReduceOp.AVG else want, exact=False)
    report["generations"] = transport.generation
    # Too large for a slot: the process group serves it, shared memory is not touched.
    big = torch.randn(1, world * 4096, 8, generator=gen)
    before = transport.generation
    check(sequence_comm._reduce_scatter(big, group), gloo_reduce_scatter(big, 1, group), False)
    report["fallback_untouched"] = transport.generation == before
    # A peer that never arrives: the others raise after the timeout instead of hanging.
    if rank == world - 1:
        time.sleep(transport.timeout_s + 2)
    else:
        start = time.monotonic()
        try:
            transport.all_reduce(torch.ones(4), "sum")
            report["timeout"] = "no error"
        except TimeoutError as e:
            report["timeout"] = str(e)
            report["timeout_after_s"] = time.monotonic() - start
    shm_comm.disable_all()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def dead_peer(out, rank, world, transport):
    """The last rank exits for good; the others must fail fast, not wait for the timeout."""
    transport.timeout_s = 120
    transport.all_reduce(torch.ones(4), "sum")  # everyone alive and in step
    if rank == world - 1:
        os._exit(0)
    start = time.monotonic()
    try:
        transport.all_reduce(torch.ones(4), "sum")
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"error": error, "after_s": time.monotonic() - start}, f)
    os._exit(0)  # gloo cannot shut down cleanly with a peer gone


if __name__ == "__main__":
    main()
