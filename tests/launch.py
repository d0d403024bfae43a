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

Most of a small multi-process test is each rank importing torch and the trainer (about 70% of a
4-rank parity launch on a 2-core host). `run_ranks` therefore forks its ranks from a zygote: a
multiprocessing forkserver that imported those modules once per test session, with one thread
per process and no process group. Each rank then gets the environment, argv, working directory
and stdout / stderr files it would have as `python script ...`, and its exit status is the
script's. `fresh=True` starts plain processes instead.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import multiprocessing
import os
import re
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
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


def recipe(args: list[str], ranks: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    """recipes/llama.py with `args`, as a user starts it: `python` for one rank, torchrun
    --standalone for several; its output captured."""
    script = ["recipes/llama.py", *args]
    cmd = torchrun(ranks, *script) if ranks > 1 else [sys.executable, *script]
    return subprocess.run(
        cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=timeout
    )


def recipe_run(run_dir: Path, *args: str, ranks: int = 1, timeout: float = 300) -> tuple[str, dict]:
    """A recipes/llama.py run into `run_dir` that must succeed: its stdout and summary.json."""
    proc = recipe([*args, "--metrics.run_dir", str(run_dir)], ranks, timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((Path(run_dir) / "summary.json").read_text())


def recipe_error(*args: str, timeout: float = 300) -> str:
    """The one stderr line of a recipes/llama.py run that must stop on a bad setting: exit 2,
    before its first step."""
    proc = recipe(list(args), timeout=timeout)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert not re.search(r"^step \d", proc.stdout, re.MULTILINE), proc.stdout[-3000:]
    return lines[0]


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


# What every rank of the tests imports: the zygote imports it once, its ranks inherit it.
ZYGOTE_PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "hybrid2d.trainer",
    "hybrid2d.checkpoint.hf",
    "tests.reference",
]


@functools.cache
def _zygote():
    """The forkserver context, its server started (once) with one thread per process, as
    `rank_env` gives every rank: torch reads OMP_NUM_THREADS when it is imported."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(ZYGOTE_PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


def _zygote_rank(args: list[str], env: dict, out: str, err: str) -> None:
    """In a process forked from the zygote: become `python *args` with `env` in REPO."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = str(REPO / args[0])
            sys.argv = [script, *args[1:]]
            sys.path.insert(0, os.path.dirname(script))  # as `python script` puts it first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # What the interpreter does at exit; os._exit below skips it (a forked child must not
        # run the zygote's own exit machinery).
        atexit._run_exitfuncs()  # private; no public way to run them before os._exit
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_ranks(
    world: int,
    args: list[str],
    timeout: float = 300,
    env: dict | None = None,
    fresh: bool = False,
) -> list[subprocess.CompletedProcess]:
    """Run `python args...` as ranks 0..world-1; return each rank's completed process. This
    process serves their store, as torchrun's agent would. The ranks are forked from the zygote
    unless `fresh`."""
    if fresh:
        return _run_fresh(world, args, timeout, env)
    ctx = _zygote()
    store = host_store()
    results = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs = []
        for r in range(world):
            files = (os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err"))
            rank_vars = {**rank_env(r, world, store.port), **(env or {})}
            proc = ctx.Process(target=_zygote_rank, args=(args, rank_vars, *files))
            proc.start()
            procs.append((proc, files))
        try:
            deadline = time.monotonic() + timeout
            for proc, _ in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.exitcode is None:
                    raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        finally:
            for proc, _ in procs:
                if proc.exitcode is None:
                    proc.kill()
                    proc.join()
            del store
        for proc, (out, err) in procs:
            with open(out) as o, open(err) as e:
                results.append(
                    subprocess.CompletedProcess(
                        [sys.executable, *args], proc.exitcode, o.read(), e.read()
                    )
                )
    return results


def _run_fresh(world, args, timeout, env) -> list[subprocess.CompletedProcess]:
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
