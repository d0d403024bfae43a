"""Benchmark (not a test): time per collective, hybrid2d_shm default group vs a gloo group.

usage: run as ranks (tests/launch.py run_ranks, or torchrun): shm_backend_bench.py [OPS]
Both transports run in one job on the same inputs, in alternating blocks of 20 back-to-back
collectives (so both see the same machine load). Each collective is timed on its own; rank 0
prints, per collective and size, the median and p90 of OPS timings and the CPU time per
collective (process time, gloo's threads included) for both transports.
"""

import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid2d import shm_backend as sb

warnings.filterwarnings("ignore", category=FutureWarning)
BLOCK = 20


def measure(fn, group, times, cpu):
    start_cpu = time.process_time()
    for _ in range(BLOCK):
        start = time.perf_counter()
        fn(group)
        times.append(time.perf_counter() - start)
    cpu.append((time.process_time() - start_cpu) / BLOCK)


def main():
    ops = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    sb.register()
    dist.init_process_group(f"cpu:{sb.BACKEND}", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    shm, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
    assert sb.uses_shared_memory(shm)
    for nbytes in (4 << 10, 64 << 10, 1 << 20, 8 << 20):
        k = nbytes // 4
        x, y, z = torch.randn(k), torch.randn(n * k), torch.zeros(k)
        ag_out, rs_out = torch.empty(n * k), torch.empty(k)
        cases = {
            "all_gather_into_tensor": lambda g, o=ag_out, x=x: dist.all_gather_into_tensor(
                o, x, group=g
            ),
            "reduce_scatter_tensor": lambda g, o=rs_out, y=y: dist.reduce_scatter_tensor(
                o, y, group=g
            ),
            "all_reduce": lambda g, z=z: dist.all_reduce(z, group=g),
        }
        for name, fn in cases.items():
            results = {"shm": ([], []), "gloo": ([], [])}
            for group in (shm, gloo):  # warm-up: slots grow, gloo connects
                measure(fn, group, [], [])
            for _ in range(ops // BLOCK):
                for label, group in (("shm", shm), ("gloo", gloo)):
                    dist.barrier(group=gloo)
                    measure(fn, group, *results[label])
            if rank == 0:
                line = f"{name:23s} {nbytes / 1024:5.0f} KiB/rank n={n}"
                for label, (times, cpu) in results.items():
                    p90 = sorted(times)[int(0.9 * (len(times) - 1))]
                    line += (
                        f"  {label} median {statistics.median(times) * 1e6:7.1f} us "
                        f"(p90 {p90 * 1e6:7.1f}, cpu {statistics.median(cpu) * 1e6:7.1f})"
                    )
                ratio = statistics.median(results["gloo"][0]) / statistics.median(results["shm"][0])
                print(f"{line}  gloo/shm x{ratio:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
