"""Worker: the hybrid2d_shm process-group backend against plain gloo; rank 0 writes JSON.

usage: shm_backend_worker.py MODE OUT
  equal   collectives on the shared-memory default group == the same on a gloo group
  train   TP x FSDP2 MLP, 3 SGD steps on a shared-memory mesh and on a gloo mesh; DCP round trip
  desync  rank 0 all-gathers while rank 1 reduce-scatters (each rank writes OUT.<rank>)
  dead    a peer that sleeps past the timeout, then a peer that exits during a collective
"""

import contextlib
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from hybrid2d import shm_backend as sb

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own deprecations
warnings.filterwarnings("ignore", category=UserWarning)

SHM = f"cpu:{sb.BACKEND}"


def init(timeout_s: float) -> None:
    sb.register()
    dist.init_process_group(backend=SHM, timeout=timedelta(seconds=timeout_s))


def write(path, report):
    with open(path, "w") as f:
        json.dump(report, f)


# ---- equal ---------------------------------------------------------------------------------------


def equal(out):
    threads = len(os.listdir("/proc/self/task"))
    sb.SLOT_CAP_BYTES = 1 << 20  # read when a group is made: a smaller cap to test the fallback
    init(60)
    report = compare_with_gloo()
    if dist.get_rank() == 0:
        write(out, report)
    dist.destroy_process_group()
    gc.collect()
    # destroy_process_group shut every group down: segments unmapped, gloo's threads joined.
    with open("/proc/self/maps") as f:
        assert f"/memfd:{sb.BACKEND}" not in f.read()
    left = len(os.listdir("/proc/self/task"))
    assert left == threads, f"{left} threads after destroy_process_group, {threads} before init"


@contextlib.contextmanager
def counted(report, group, ops=1):
    """The block ran `ops` collectives through shared memory (growing a slot adds one)."""
    before = sb.collective_count(group)
    yield
    done = sb.collective_count(group) - before
    assert done in (ops, ops + 1), (ops, done)
    report["shm_ops"] += ops


def compare_with_gloo():
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    assert sb.uses_shared_memory(world), sb.fallback_reason(world)
    gloo = dist.new_group(backend="gloo")
    assert not sb.uses_shared_memory(gloo)
    report = {"checked": 0, "max_error": 0.0, "shm_ops": 0}

    def check(got, want, exact):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        if exact:
            assert torch.equal(got, want), (got, want)
        else:
            got, want = got.double(), want.double()
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
            report["max_error"] = max(report["max_error"], err)
            assert err < 1e-6, err
        report["checked"] += 1

    gen = torch.Generator().manual_seed(1000 + rank)
    results = []
    report["rounds"] = rounds = 12
    for it in range(rounds):
        # Sizes from a few elements to past the first slot (64 KiB: the group grows), each in
        # fp32 and bf16, 1-D and 2-D.
        k = [5, 1000, 3, 17000, 40, 60000][it % 6] + it
        dtype = torch.bfloat16 if it // 6 else torch.float32
        shape = (k,) if it % 4 < 2 else (k, 1)

        def rand(*size, dtype=dtype):
            if dtype == torch.bfloat16:  # integers: sums are exact in any order
                return torch.randint(-8, 9, size, generator=gen).to(dtype)
            return torch.randn(*size, generator=gen)

        x = rand(*shape)
        # all_gather_into_tensor
        got = torch.empty((n * shape[0], *shape[1:]), dtype=dtype)
        with counted(report, world):
            dist.all_gather_into_tensor(got, x, group=world)
        want = torch.empty_like(got)
        dist.all_gather_into_tensor(want, x, group=gloo)
        check(got, want, exact=True)
        # in place, as FSDP2 does it: the input is this rank's row of the output
        got = torch.empty((n * shape[0], *shape[1:]), dtype=dtype)
        mine = got.view(n, -1)[rank].view(shape)
        mine.copy_(x)
        with counted(report, world):
            dist.all_gather_into_tensor(got, mine, group=world)
        check(got, want, exact=True)
        # reduce_scatter_tensor, sum and average
        y = rand(n * shape[0], *shape[1:])
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            got, want = torch.empty_like(x), torch.empty_like(x)
            with counted(report, world):
                dist.reduce_scatter_tensor(got, y, op=op, group=world)
            dist.reduce_scatter_tensor(want, y, op=op, group=gloo)
            check(got, want, exact=dtype == torch.bfloat16 and op == dist.ReduceOp.SUM)
        # all_reduce, sum and max
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            got, want = x.clone(), x.clone()
            with counted(report, world):
                dist.all_reduce(got, op=op, group=world)
            dist.all_reduce(want, op=op, group=gloo)
            check(got, want, exact=op == dist.ReduceOp.MAX or dtype == torch.bfloat16)
            results.append(got)
        # functional collectives
        flat = x.flatten()
        with counted(report, world):
            got = fc.all_gather_single(flat, 0, world).wait()
        want = fc.all_gather_single(flat, 0, gloo).wait()
        check(got, want, exact=True)
        with counted(report, world):
            got = fc.all_gather_tensor(x, 0, world).wait()
        check(got, fc.all_gather_tensor(x, 0, gloo).wait(), exact=True)
        yflat = y.flatten()
        with counted(report, world):
            got = fc.reduce_scatter_single(yflat, "sum", 0, world).wait()
        want = fc.reduce_scatter_single(yflat, "sum", 0, gloo).wait()
        check(got, want, exact=dtype == torch.bfloat16)
        for op in ("sum", "max"):
            with counted(report, world):
                got = fc.all_reduce(x, op, world).wait()
            want = fc.all_reduce(x, op, gloo).wait()
            check(got, want, exact=op == "max" or dtype == torch.bfloat16)
        # objects (gloo inside the shared-memory group)
        objs = [None] * n
        dist.all_gather_object(objs, {"rank": rank, "it": it, "sum": float(x.float().sum())})
        ref = [None] * n
        dist.all_gather_object(
            ref, {"rank": rank, "it": it, "sum": float(x.float().sum())}, group=gloo
        )
        assert objs == ref, (objs, ref)
        report["checked"] += 1
    # Every rank computed bit-identical all-reduce results.
    digest = hashlib.sha256(b"".join(r.view(torch.uint8).numpy().tobytes() for r in results))
    digests = [None] * n
    dist.all_gather_object(digests, digest.hexdigest())
    report["identical_all_reduce"] = len(set(digests)) == 1
    # Above the slot cap (1 MiB here): gloo serves it, shared memory is not touched.
    before = sb.collective_count(world)
    big = torch.randn(n * (1 << 18), generator=gen)  # 1 MiB per rank after the scatter
    got, want = torch.empty(1 << 18), torch.empty(1 << 18)
    dist.reduce_scatter_tensor(got, big, group=world)
    dist.reduce_scatter_tensor(want, big, group=gloo)
    check(got, want, exact=False)
    report["cap_delegated"] = sb.collective_count(world) == before
    # Under a dispatch mode the shared-memory path runs as dispatcher ops (CommDebugMode sees
    # them), with the same results.
    from torch.distributed.tensor.debug import CommDebugMode

    x, y = torch.randn(6, generator=gen), torch.randn(6 * n, generator=gen)
    with CommDebugMode() as mode, counted(report, world, ops=3):
        mode.comm_registry.update(sb.DISPATCH_OPS)
        got_ag, got_rs, got_ar = torch.empty(6 * n), torch.empty(6), x.clone()
        dist.all_gather_into_tensor(got_ag, x, group=world)
        dist.reduce_scatter_tensor(got_rs, y, group=world)
        dist.all_reduce(got_ar, group=world)
    report["seen_by_mode"] = {str(k): v for k, v in mode.get_comm_counts().items()}
    want_ag, want_rs, want_ar = torch.empty(6 * n), torch.empty(6), x.clone()
    dist.all_gather_into_tensor(want_ag, x, group=gloo)
    dist.reduce_scatter_tensor(want_rs, y, group=gloo)
    dist.all_reduce(want_ar, group=gloo)
    check(got_ag, want_ag, exact=True)
    check(got_rs, want_rs, exact=False)
    check(got_ar, want_ar, exact=False)
    # Collectives without a shared-memory path, on the shared-memory default group.
    t = torch.full((4,), float(rank))
    dist.broadcast(t, src=1)
    assert t.tolist() == [1.0] * 4
    objs = [rank * 10] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [0]
    part = torch.empty(2)
    dist.scatter(part, [torch.full((2,), float(r)) for r in range(n)] if rank == 0 else None, 0)
    assert part.tolist() == [float(rank)] * 2
    parts = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    dist.gather(part, parts, dst=0)
    if rank == 0:
        assert [p[0].item() for p in parts] == list(range(n))
    dist.barrier()
    # A subgroup with the default backend (as DeviceMesh makes them) uses shared memory too.
    sub = dist.new_group([0, 1])
    if rank < 2:
        assert sb.uses_shared_memory(sub)
        t = torch.full((3,), rank + 1.0)
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [3.0] * 3 and sb.collective_count(sub) == 1
    # The segment is anonymous: mapped as a memfd, no file in /dev/shm.
    with open("/proc/self/maps") as f:
        maps = f.read()
    report["memfd_mapped"] = f"/memfd:{sb.BACKEND}" in maps
    report["dev_shm_mapped"] = "/dev/shm/" in maps
    report["generations"] = sb.collective_count(world)
    dist.barrier()
    return report


# ---- train ---------------------------------------------------------------------------------------


def train(out):
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    init(60)
    rank = dist.get_rank()
    names = ("dp_replicate", "dp_shard", "tp")

    def run(override, dtype=torch.float32):
        mesh = init_device_mesh(
            "cpu",
            (1, 2, 2),
            mesh_dim_names=names,
            backend_override={d: override for d in names} if override else None,
        )
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=override)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        gen = torch.Generator().manual_seed(100 + flat.get_local_rank())  # batch per dp rank
        losses = []
        for _ in range(3):
            x = torch.randn(8, 16, generator=gen).to(dtype)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total, group=flat.get_group())
            losses.append(total.item() / 2)
        groups = [mesh.get_group(d) for d in names] + [flat.get_group()]
        return model, losses, [sb.uses_shared_memory(g) for g in groups], groups

    model, shm_losses, shm_used, groups = run(None)
    ops = {g.group_desc: sb.collective_count(g) for g in groups}
    _, gloo_losses, gloo_used, _ = run("gloo")
    # FSDP2 in bf16: bf16 all-gathers and reduce-scatters (average).
    bf16_shm = run(None, torch.bfloat16)[1]
    bf16_gloo = run("gloo", torch.bfloat16)[1]
    # DCP save and load through the shared-memory groups.
    ckpt = os.path.join(os.path.dirname(out), "dcp")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = {"model": model.state_dict()}
    dcp.load(loaded, checkpoint_id=ckpt)
    restored = all(
        torch.equal(v.full_tensor(), state[k].full_tensor()) for k, v in model.state_dict().items()
    )
    if rank == 0:
        write(
            out,
            {
                "shm_losses": shm_losses,
                "gloo_losses": gloo_losses,
                "shm_used": shm_used,
                "gloo_used": gloo_used,
                "ops": ops,
                "restored": restored,
                "bf16_shm_losses": bf16_shm,
                "bf16_gloo_losses": bf16_gloo,
            },
        )
    dist.destroy_process_group()


# ---- desync --------------------------------------------------------------------------------------


def desync(out):
    init(60)
    rank = dist.get_rank()
    x = torch.ones(1024)
    dist.all_reduce(x)  # in step once
    start = time.monotonic()
    try:
        if rank == 0:
            dist.all_gather_into_tensor(torch.empty(2048), x)
        else:
            dist.reduce_scatter_tensor(torch.empty(1024), torch.ones(2048))
        error = None
    except RuntimeError as e:
        error = str(e)
    write(f"{out}.{rank}", {"error": error, "after_s": time.monotonic() - start})
    if error:
        print(error, file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


# ---- dead ----------------------------------------------------------------------------------------


def dead(out):
    timeout = 3
    init(timeout)
    rank, n = dist.get_rank(), dist.get_world_size()
    other = dist.new_group()  # a second shared-memory group, made while everyone is here
    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    report = {"pids": pids}
    # A peer that never arrives: the others raise after the group's timeout.
    if rank == n - 1:
        time.sleep(timeout + 1.5)
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            report["timeout"] = "no error"
        except RuntimeError as e:
            report["timeout"] = str(e)
        report["timeout_after_s"] = time.monotonic() - start
    # A peer that exits: the others raise within about a second, naming it.
    dist.all_reduce(torch.ones(4), group=other)  # everyone alive and in step
    if rank == n - 1:
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=other)
        report["dead"] = "no error"
    except RuntimeError as e:
        report["dead"] = str(e)
    report["dead_after_s"] = time.monotonic() - start
    if rank == 0:
        write(out, report)
    os._exit(0)  # gloo cannot shut down cleanly with a peer gone


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    tempfile.tempdir = os.path.dirname(out)
    {"equal": equal, "train": train, "desync": desync, "dead": dead}[mode](out)
