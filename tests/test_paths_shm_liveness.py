"""A peer SIGKILLed while the others wait in a shared-memory collective is noticed by the wait's
liveness check, not by the timeout (README: the shared-memory backend).

The group's timeout is 120 s, so the outcome is decided by the message, not by a clock: every
survivor's error must say that the killed rank (by rank and pid) exited during the collective; a
timeout would say "timed out" and come two minutes later. The delay between the kill and each
error is measured with CLOCK_MONOTONIC (one clock for all processes of a Linux host) and
printed, not asserted: it depends on the machine's load.
"""

import json
import os
import re

import pytest

from hybrid2d import shm_backend
from tests.launch import check_ok, run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shm_backend.unavailable_reason() is not None,
        reason=f"shared memory unavailable: {shm_backend.unavailable_reason()}",
    ),
]

TIMEOUT_S = 120
WORLD = 3


def rank_main(out: str) -> None:
    """One rank: the last rank SIGKILLs itself instead of joining an all-reduce the others wait
    in; each rank writes OUT.<rank>.json (the victim just before it dies)."""
    import signal
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    shm_backend.register()
    dist.init_process_group(
        backend=f"cpu:{shm_backend.BACKEND}", timeout=timedelta(seconds=TIMEOUT_S)
    )
    rank, n = dist.get_rank(), dist.get_world_size()
    pids = [None] * n
    dist.all_gather_object(pids, os.getpid())
    dist.all_reduce(torch.ones(4))  # every rank alive and in step on the shared-memory path
    path = f"{out}.{rank}.json"
    if rank == n - 1:
        time.sleep(0.3)  # the others are (most likely) asleep in the wait by now; either way
        with open(path, "w") as f:  # they must find this rank gone
            json.dump({"killed_at": time.monotonic()}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    report = {"pids": pids}
    try:
        dist.all_reduce(torch.ones(4))
        report["error"] = "no error"
    except RuntimeError as e:
        report["error"] = str(e)
    report["error_at"] = time.monotonic()
    with open(path, "w") as f:
        json.dump(report, f)
    os._exit(0)  # gloo cannot shut down cleanly with a peer gone


def test_killed_peer_is_noticed_by_liveness_not_by_the_timeout(tmp_path):
    out = str(tmp_path / "liveness")
    code = "import sys; from tests.test_paths_shm_liveness import rank_main; rank_main(sys.argv[1])"
    results = run_ranks(WORLD, ["-c", code, out], timeout=TIMEOUT_S + 120)
    victim = WORLD - 1
    assert results[victim].returncode == -9, results[victim].stderr[-2000:]
    check_ok(results[:victim])
    with open(f"{out}.{victim}.json") as f:
        killed_at = json.load(f)["killed_at"]
    delays = []
    for rank in range(victim):
        with open(f"{out}.{rank}.json") as f:
            report = json.load(f)
        pid = report["pids"][victim]
        expected = (
            rf"rank {rank}: group rank {victim} \(rank {victim}, pid {pid}\) exited during "
            r"shared-memory collective \d+"
        )
        assert re.fullmatch(expected, report["error"]), report["error"]
        delays.append(report["error_at"] - killed_at)
    print(f"SIGKILLed peer noticed after {', '.join(f'{d * 1000:.0f} ms' for d in delays)}")
    assert all(0 < d < TIMEOUT_S for d in delays)  # after the kill; not the timeout (message)
