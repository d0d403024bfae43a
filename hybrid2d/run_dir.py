"""The run directory: created and checked by rank 0, and locked against a second run.

The lock is a file holding the owner's host and pid, created with O_EXCL. A lock whose process
is gone (a crash, kill -9, a launcher restart) is stale and taken over; a live one stops the new
run with one line naming the directory and the owner.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time

from hybrid2d.config import ConfigError, JobConfig

LOCK_NAME = ".lock"
_held: list[str] = []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(run_dir: str) -> None:
    path = os.path.join(run_dir, LOCK_NAME)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                owner = {}
            same_host = owner.get("host") == me["host"]
            if same_host and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
                os.unlink(path)  # stale: its process is gone
                continue
            where = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "another run"
            hint = "" if same_host else f"; if that run is over, delete {path}"
            raise ConfigError(
                f"metrics.run_dir={run_dir} is in use by {where} (lock {path}); use another "
                f"--metrics.run_dir or stop that run{hint}"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        _held.append(path)
        return


def release_locks() -> None:
    while _held:
        path = _held.pop()
        try:
            with open(path) as f:
                if json.load(f).get("pid") == os.getpid():
                    os.unlink(path)
        except (OSError, ValueError):
            pass


atexit.register(release_locks)


def create_run_dir(cfg: JobConfig) -> str:
    """Name, create, lock the run directory and write config.json (rank 0 only)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        path = cfg.metrics.run_dir.format(recipe=cfg.recipe, time=stamp)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"metrics.run_dir={cfg.metrics.run_dir!r} has an unknown placeholder ({e}); "
            "use {recipe} and {time} only"
        ) from None
    if cfg.checkpoint.resume == "auto":  # continue the newest run that has a checkpoint
        from hybrid2d.checkpoint.layout import find_run_to_resume

        path = find_run_to_resume(cfg.metrics.run_dir, cfg.recipe) or path
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"metrics.run_dir={path} is not writable ({e.strerror}); choose a directory you "
            "can write to with --metrics.run_dir"
        ) from None
    acquire_lock(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    return path
