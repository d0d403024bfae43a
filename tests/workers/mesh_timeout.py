"""Worker: a (1, 2, 2) mesh whose groups time out after TIMEOUT_S; rank 2 stays away (sleeps
past the others' wait) and rank 3 all-reduces over the tp group {2, 3}. Rank 3 prints
{"seconds": how long until its collective failed} as JSON (null: it did not fail).

usage: mesh_timeout.py SHM_COLLECTIVES TIMEOUT_S
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from hybrid2d.config import JobConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed


def main():
    setting, timeout_s = sys.argv[1], int(sys.argv[2])
    init_distributed("cpu", timeout_s, setting)
    mesh = build_mesh("cpu", RunLayout.build(JobConfig(), 4, dp_shard=2, tp=2), timeout_s)
    rank = dist.get_rank()
    if rank == 2:
        time.sleep(timeout_s + 8)
    elif rank == 3:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=mesh.tp_mesh.get_group())
            seconds = None
        except Exception:  # noqa: BLE001 - gloo and shared memory raise different kinds
            seconds = time.monotonic() - start
        print(json.dumps({"seconds": seconds}), flush=True)
    os._exit(0)  # no shutdown barrier: the point is the peers' timeout alone


if __name__ == "__main__":
    main()
