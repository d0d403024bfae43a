"""The run directory: created and checked by rank 0, and locked against a second run.

The lock is an `fcntl.flock` on `<run_dir>/.lock`; the file also holds the owner's host and pid
for the message that refuses a second run. The kernel drops a flock when the process that holds
it ends, however it ends (exit, crash, kill -9), so a dead run's lock is free at once, and the
flock alone decides who holds it: two starters can never both take over a stale lock, since
there is nothing to take over, only a lock to try. The owner unlinks the file while it still
holds the lock, and a starter that locked a file which is no longer the one at the path tries
again, so an unlink never lets two runs in either.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from hybrid2d.checkpoint.layout import find_run_to_resume, holds_checkpoint, write_text_atomic
from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError

LOCK_NAME = ".lock"
EARLIER_RUN = ("config.json", "summary.json", "tensorboard")  # what a launch that trained leaves
_held: list[tuple[str, int]] = []  # (lock path, descriptor holding its flock)
_created: list[str] = []  # run directories this process made (removed on release if empty)


def _owner(fd: int) -> dict:
    """The owner of a lock another process holds, as its file names it. Right after it took
    the lock the file may still be empty or name the dead process before it; give the new
    owner a moment to write itself in ({} if it does not: the message then says "another
    process")."""
    for _ in range(200):
        try:
            owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):  # half written
            owner = {}
        pid = owner.get("pid")
        if isinstance(pid, int) and (owner.get("host") != socket.gethostname() or _alive(pid)):
            return owner
        time.sleep(0.005)
    return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # EPERM: alive, another user's
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def acquire_lock(run_dir: str) -> None:
    """Hold `run_dir`'s lock until `release_locks()` or the end of this process; a ConfigError
    naming the owner's pid when another process holds it."""
    path = os.path.join(run_dir, LOCK_NAME)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process holds it
            owner = _owner(fd)
            os.close(fd)
            where = f"pid {owner['pid']} on {owner.get('host')}" if owner else "another process"
            raise ConfigError(
                f"metrics.run_dir={run_dir} is in use by {where} (lock {path}); use another "
                "--metrics.run_dir or stop that run"
            ) from None
        except OSError as e:
            os.close(fd)
            raise ConfigError(
                f"metrics.run_dir={run_dir}: cannot lock {path} ({e.strerror}); use a directory "
                "on a file system with file locks"
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its owner unlinked it on release: lock the new one
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _held.append((path, fd))


def release_locks(discard_created: bool = False) -> None:
    """Give up every lock this process holds (the file is removed first, under the lock), and
    remove a run directory this process made if nothing was written into it (a refused launch
    leaves no empty directory behind). discard_created: remove it with what it holds (a start-up
    stopped by a preemption signal wrote config.json and a TensorBoard file but trained nothing,
    and a relaunch would refuse them as an earlier run)."""
    while _held:
        path, fd = _held.pop()
        with contextlib.suppress(OSError):
            if _same_file(fd, path):
                os.unlink(path)
        os.close(fd)
    while _created:
        path = _created.pop()
        if discard_created:
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty: the run wrote into it
            os.rmdir(path)


atexit.register(release_locks)


def create_run_dir(cfg: JobConfig) -> str:
    """Name, create and lock the run directory (rank 0 only); without --checkpoint.resume, refuse
    one an earlier launch trained in. Its config.json is written by `write_run_config` once the
    run has passed its checks."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        path = cfg.metrics.run_dir.format(recipe=cfg.recipe, time=stamp)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"metrics.run_dir={cfg.metrics.run_dir!r} has an unknown placeholder ({e}); "
            "use {recipe} and {time} only"
        ) from None
    if cfg.checkpoint.resume == "auto":  # continue the newest run that has a checkpoint
        path = find_run_to_resume(cfg.metrics.run_dir, cfg.recipe) or path
    try:
        try:
            os.makedirs(path)
            _created.append(path)
        except FileExistsError:
            pass
        acquire_lock(path)  # creating the lock file is the test that the directory is writable
    except OSError as e:
        raise ConfigError(
            f"metrics.run_dir={path} is not writable ({e.strerror}); choose a directory you "
            "can write to with --metrics.run_dir"
        ) from None
    if not cfg.checkpoint.resume:
        refuse_earlier_run(path)
    return path


def refuse_earlier_run(path: str) -> None:
    """ConfigError if a launch that trains afresh would write over an earlier launch's run
    (its config.json and summary.json replaced, a second TensorBoard file over the same steps).
    A run dir with checkpoints is left to `find_resume`, whose refusal names them."""
    if holds_checkpoint(path):
        return
    found = [name for name in EARLIER_RUN if os.path.exists(os.path.join(path, name))]
    if found:
        raise ConfigError(
            f"metrics.run_dir={path} holds an earlier run ({', '.join(found)}) and no checkpoint "
            "to continue from; train in another --metrics.run_dir, or delete that directory first"
        )


def write_run_config(path: str, cfg: JobConfig) -> None:
    """The run's config.json (rank 0), written only once data and any resume checkpoint have
    been checked: a launch refused with a config error leaves an earlier run's file as it was."""
    write_text_atomic(Path(path) / "config.json", json.dumps(cfg.to_dict(), indent=2))
