"""Start N local ranks of a script the way torchrun would (env://), for multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ):
        env.pop(var, None)
    return env


def rank_env(rank: int, world: int, port: int, local_world: int | None = None) -> dict:
    local_world = local_world or world
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def run_ranks(
    world: int, args: list[str], timeout: float = 300
) -> list[subprocess.CompletedProcess]:
    """Run `python args...` as ranks 0..world-1; return each rank's completed process."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=rank_env(r, world, port),
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
    return results


def check_ok(results: list[subprocess.CompletedProcess]) -> None:
    bad = [(i, r) for i, r in enumerate(results) if r.returncode != 0]
    if bad:
        i, r = bad[0]
        raise AssertionError(
            f"rank {i} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        )
