"""Start local ranks for multi-process tests without port races.

No test picks a "free" port and hands it to a launcher: a port found free can be taken by
another job before the launcher binds it. Instead
- `run_ranks` hosts the ranks' TCPStore in this process on a port the OS assigns while binding
  it, and tells the ranks to use it as torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE);
- `torchrun(n, ...)` is torchrun --standalone: its agent binds port 0 for the rendezvous and for
  the ranks' store;
- `host_store()` + `rendezvous_args(store)` host a c10d rendezvous for torchrun launchers acting
  as several nodes (`--rdzv-conf is_host=false`: every launcher joins it as a client);
- accelerate picks its port itself (`--main_process_port 0`) and checks it before launching;
  `retry_if_port_taken` reruns a launch whose output says the address was taken in between;
- accelerate as several nodes must be told node 0's port: `reserved_port()` holds one that no
  other process can be given until node 0's store takes it over.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]

PORT_TAKEN = ("address already in use", "eaddrinuse", "is utilizing it")


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port held by this process while the block runs, for a launcher that must be told its
    port (accelerate acting as two nodes). The socket is bound with SO_REUSEADDR but never
    listens: the OS hands the port to no one else (bind(0) and outgoing connections skip a
    bound port), accelerate's "in use" probe finds nothing listening, and the launcher's store,
    which binds with SO_REUSEADDR too, takes it over."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def host_store() -> dist.TCPStore:
    """A TCPStore served from this process on a port the OS picked while binding it."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )


def rendezvous_args(store: dist.TCPStore) -> list[str]:
    """torchrun arguments that join a c10d rendezvous held in `store` (from host_store)."""
    return [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{store.port}",
        "--rdzv-conf",
        "is_host=false",
        "--rdzv-id",
        f"test-{store.port}",  # the same on every launcher of the job
    ]


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of a one-node torchrun launch (--standalone: ports picked by binding)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *args,
    ]


def port_taken(*outputs: str | None) -> bool:
    text = "\n".join(o or "" for o in outputs).lower()
    return any(s in text for s in PORT_TAKEN)


def retry_if_port_taken(launch: Callable[[], subprocess.CompletedProcess], attempts: int = 3):
    """Run `launch()` (a launcher that picks its own port) again when its output says the port
    was taken between the pick and the bind; any other outcome is returned as it is."""
    for _ in range(attempts - 1):
        proc = launch()
        if proc.returncode == 0 or not port_taken(proc.stdout, proc.stderr):
            return proc
    return launch()


def launcher_env(**extra: str) -> dict:
    """This environment for starting a launcher or a one-process run: one thread per process
    and none of the rank variables a surrounding launch may have set."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        env.pop(var, None)
    return env


def rank_env(rank: int, world: int, port: int, local_world: int | None = None) -> dict:
    """The environment of one rank whose store another process (a launcher) serves on `port`."""
    local_world = local_world or world
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def run_ranks(
    world: int, args: list[str], timeout: float = 300, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """Run `python args...` as ranks 0..world-1; return each rank's completed process. This
    process serves their store, as torchrun's agent would."""
    store = host_store()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env={**rank_env(r, world, store.port), **(env or {})},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    return results


def check_ok(results: list[subprocess.CompletedProcess]) -> None:
    bad = [(i, r) for i, r in enumerate(results) if r.returncode != 0]
    if bad:
        i, r = bad[0]
        raise AssertionError(
            f"rank {i} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        )
