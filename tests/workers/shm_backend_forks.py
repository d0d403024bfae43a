"""Driver: forks 2-rank jobs of the hybrid2d_shm backend, one per scenario; writes JSON to OUT.

usage: shm_backend_forks.py MODE OUT
  kill    a rank kills itself at one point of a group's set-up (or of a growth); the survivor
          must fail fast, and nothing may be left in /dev/shm
  policy  parallel.shm_collectives on / auto with shared memory unavailable on one rank, and a
          group that looks as if it spanned hosts

torch is imported once here and each scenario's ranks are forked from this process (no threads
exist before the fork), which costs a fraction of starting fresh interpreters.
"""

import json
import os
import re
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid2d import shm_backend as sb
from hybrid2d.errors import ConfigError

WORLD = 2


def fork_job(workdir: str, name: str, body, timeout_s: float = 60) -> list[dict]:
    """Run body(rank) in WORLD forked ranks joined by a FileStore; each rank's JSON result
    (its return value, or {"error": ...}), plus its pid, exit status and run time."""
    store_path = os.path.join(workdir, f"{name}.store")
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:  # the rank
            status = 0
            try:
                store = dist.FileStore(store_path, WORLD)
                result = body(rank, store)
            except BaseException as e:  # noqa: BLE001 - reported to the driver
                result = {"error": str(e), "type": type(e).__name__}
                traceback.print_exc()
                status = 3
            with open(os.path.join(workdir, f"{name}.{rank}.json"), "w") as f:
                json.dump(result, f)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)  # no teardown: gloo cannot always shut down with a peer gone
        pids.append(pid)
    start = time.monotonic()
    statuses = {}
    while len(statuses) < WORLD:
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = (status, time.monotonic() - start)
        if time.monotonic() - start > timeout_s:
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    statuses[pid] = ("hung", time.monotonic() - start)
        time.sleep(0.02)
    results = []
    for rank, pid in enumerate(pids):
        path = os.path.join(workdir, f"{name}.{rank}.json")
        result = {}
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        status, elapsed = statuses[pid]
        if isinstance(status, int):
            status = (
                f"signal {os.WTERMSIG(status)}"
                if os.WIFSIGNALED(status)
                else f"exit {os.WEXITSTATUS(status)}"
            )
        results.append({**result, "pid": pid, "status": status, "seconds": round(elapsed, 2)})
    return results


def init(rank, store, backend=f"cpu:{sb.BACKEND}", timeout_s=20):
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout_s)
    )


# ---- kill ----------------------------------------------------------------------------------------

# (set-up point, the rank that dies there, how). "set-up:*" and "grow:*" are inside the segment
# handshake; group rank 0 makes the segment.
KILLS = [
    ("pipe", 1, "exit"),
    ("set-up:segment", 0, "sigkill"),
    ("set-up:mapped", 1, "sigkill"),
    ("pipes_opened", 0, "exit"),
    ("done", 1, "sigkill"),
    ("grow:segment", 0, "exit"),
    ("grow:mapped", 1, "sigkill"),
]


def kill(workdir, out):
    report = {"runs": []}
    for point, victim, how in KILLS:

        def body(rank, store, point=point, victim=victim, how=how):
            def hook(name):
                if name == point and rank == victim:
                    # What this rank has at this point: its descriptors' targets.
                    fds = os.listdir("/proc/self/fd")
                    links = []
                    for fd in fds:
                        try:
                            links.append(os.readlink(f"/proc/self/fd/{fd}"))
                        except OSError:
                            pass
                    with open(os.path.join(workdir, f"fds.{point}"), "w") as f:
                        json.dump(links, f)
                    if how == "sigkill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    os._exit(9)

            sb._setup_point = hook
            init(rank, store)
            dist.all_reduce(torch.ones(1 << 18))  # 1 MiB: the slot grows
            dist.barrier()
            return {"finished": True}

        results = fork_job(workdir, point.replace(":", "_"), body)
        fds = []
        if os.path.exists(os.path.join(workdir, f"fds.{point}")):
            with open(os.path.join(workdir, f"fds.{point}")) as f:
                fds = json.load(f)
        report["runs"].append({"point": point, "victim": victim, "results": results, "fds": fds})
    # Names these runs could have made: this backend's prefix, or one of their pids as a word
    # of the name (other jobs use /dev/shm too: nothing else is looked at).
    pids = {str(r["pid"]) for run in report["runs"] for r in run["results"]}
    report["left_in_dev_shm"] = sorted(
        name
        for name in os.listdir("/dev/shm")
        if name.startswith(sb.BACKEND) or pids & set(re.split(r"[^0-9A-Za-z]+", name))
    )
    with open(out, "w") as f:
        json.dump(report, f)


# ---- policy --------------------------------------------------------------------------------------


def policy(workdir, out):
    report = {}

    def without_shm_on_rank1(setting, backend=f"cpu:{sb.BACKEND}"):
        def body(rank, store):
            sb.configure(setting)
            if rank == 1:
                sb.unavailable_reason = lambda: "pretend /dev/shm is missing"
            try:
                init(rank, store, backend)
            except ConfigError as e:
                return {"config_error": str(e)}
            return {
                "uses": sb.uses_shared_memory(),
                "reason": sb.fallback_reason(),
                "losses": train_steps(),
                "count": sb.collective_count(),
            }

        return body

    report["on"] = fork_job(workdir, "on", without_shm_on_rank1("on"))
    report["auto"] = fork_job(workdir, "auto", without_shm_on_rank1("auto", sb.BACKEND))

    def other_host(rank, store):
        sb.configure("on")
        if rank == 1:
            sb._host_id = lambda: "another-host"
        init(rank, store)
        t = torch.ones(4)
        dist.all_reduce(t)
        return {
            "uses": sb.uses_shared_memory(),
            "reason": sb.fallback_reason(),
            "sum": t.tolist(),
        }

    report["hosts"] = fork_job(workdir, "hosts", other_host)
    with open(out, "w") as f:
        json.dump(report, f)


def train_steps():
    """Three SGD steps of a small FSDP2 model over the default group; the losses."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    sb.register()
    torch.set_num_threads(1)
    {"kill": kill, "policy": policy}[mode](os.path.dirname(os.path.abspath(out)), out)
