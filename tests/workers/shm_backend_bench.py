"""Benchmark (not a test): time per collective, hybrid2d_shm default group vs a gloo group.

usage: python tests/launch.py-style ranks: shm_backend_bench.py [ROUNDS]
Rank 0 prints one line per (collective, size): median and p90 microseconds, both transports.
Both transports run in one job, interleaved round by round, on the same inputs.
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


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    sb.register()
    dist.init_process_group(f"cpu:{sb.BACKEND}", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    shm, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
    assert sb.uses_shared_memory(shm)
    for nbytes in (4 << 10, 64 << 10, 1 << 20, 8 << 20):
        k = nbytes // 4
        x, y = torch.randn(k), torch.randn(n * k)
        ag_out, rs_out = torch.empty(n * k), torch.empty(k)
        cases = {
            "all_gather_into_tensor": lambda g, o=ag_out, x=x: dist.all_gather_into_tensor(
                o, x, group=g
            ),
            "reduce_scatter_tensor": lambda g, o=rs_out, y=y: dist.reduce_scatter_tensor(
                o, y, group=g
            ),
            "all_reduce": lambda g, x=x: dist.all_reduce(x, group=g),
        }
        for name, fn in cases.items():
            times = {"shm": [], "gloo": []}
            for i in range(rounds + 10):
                for label, group in (("shm", shm), ("gloo", gloo)):
                    dist.barrier(group=gloo)
                    start = time.perf_counter()
                    fn(group)
                    if i >= 10:  # warm-up: slots grow, gloo connects
                        times[label].append(time.perf_counter() - start)
            if rank == 0:

                def us(v, q):
                    return sorted(v)[int(q * (len(v) - 1))] * 1e6

                s, g = times["shm"], times["gloo"]
                print(
                    f"{name:24s} {nbytes / 1024:7.0f} KiB/rank  n={n}  "
                    f"shm median {statistics.median(s) * 1e6:8.1f} us (p90 {us(s, 0.9):8.1f})  "
                    f"gloo median {statistics.median(g) * 1e6:8.1f} us (p90 {us(g, 0.9):8.1f})  "
                    f"x{statistics.median(g) / statistics.median(s):.1f}",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
