"""What the launcher (torchrun, accelerate launch) tells a process: its rank, the world, and the
mesh sizes of an accelerate config. Plain Python, so the recipe can check every setting against
the world, and the files settings name, before torch is imported (a mistyped size or a missing
path fails in 0.3 s, not 4 to 13 s).

Also the launcher's two ways of ending a rank before training is under way, each set up here
because it must hold from the first line on, while torch still loads: the launcher's death
(`exit_with_launcher`) and a preemption signal during start-up (`stop_start_up_on_signals`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.paths import (
    data_source,
    init_from_dir,
    plan_hardware_file,
    resume_dir,
    tokenizer_file,
)

# accelerate's --parallelism_config_* flags reach the processes as these variables.
LAUNCHER_MESH_ENV = {
    "PARALLELISM_CONFIG_TP_SIZE": "tp",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "dp_shard",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "dp_replicate",
}


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun/accelerate set them."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def launched_mesh_env() -> dict[str, str]:
    """Each accelerate launch setting of a mesh size that is set: variable -> value."""
    return {env: os.environ[env] for env in LAUNCHER_MESH_ENV if os.environ.get(env)}


def launcher_sizes(set_on_cli: set[str] | frozenset[str]) -> dict[str, int]:
    """The mesh sizes accelerate's launch settings give and the command line does not
    (parallel field -> size): the command line wins over the launcher, the launcher over the
    recipe."""
    sizes = {}
    for env, value in launched_mesh_env().items():
        name = LAUNCHER_MESH_ENV[env]
        if f"parallel.{name}" in set_on_cli:
            continue
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ConfigError(f"{env}={value!r} is not an integer") from None
    return sizes


def launcher_sizes_note(set_on_cli: set[str] | frozenset[str]) -> str:
    """'; parallel.dp_shard=2 came from the launcher (PARALLELISM_CONFIG_DP_SHARD_SIZE)', for
    the mesh sizes launcher_sizes gives, to end an error about the mesh; '' if none."""
    taken = [
        f"parallel.{LAUNCHER_MESH_ENV[env]}={value} came from the launcher ({env})"
        for env, value in launched_mesh_env().items()
        if f"parallel.{LAUNCHER_MESH_ENV[env]}" not in set_on_cli
    ]
    return "; " + ", ".join(taken) if taken else ""


def layout_for_world(
    cfg: JobConfig, set_on_cli: set[str] | frozenset[str], world: int | None = None, **choices
) -> RunLayout:
    """cfg laid out on the launched world with the launcher's mesh sizes (and `choices`, as
    RunLayout.build takes them). An error about the mesh names the sizes the launcher gave,
    which the user never typed."""
    world = world_from_env()[1] if world is None else world
    try:
        return RunLayout.build(cfg, world, **(launcher_sizes(set_on_cli) | choices))
    except ConfigError as e:
        raise ConfigError(f"{e}{launcher_sizes_note(set_on_cli)}") from None


def check_before_torch(cfg: JobConfig, set_on_cli: set[str] | frozenset[str]) -> None:
    """Every setting checked against the world, unless the run decides some later: the
    planner's mesh (parallel.plan auto) or the model's shape from checkpoint.init_from; and
    every file a setting names, as far as the file system alone tells (hybrid2d/paths.py), in
    the order the run meets them."""
    plan_hardware_file(cfg.parallel.plan_hardware)
    if cfg.checkpoint.init_from:
        init_from_dir(cfg.checkpoint.init_from)
    launcher_sizes(set_on_cli)  # a size that is no integer fails here too
    if cfg.parallel.plan != "auto" and not cfg.checkpoint.init_from:
        layout_for_world(cfg, set_on_cli)
    if cfg.checkpoint.resume not in ("", "auto"):
        resume_dir(cfg.checkpoint.resume)
    for value, setting in ((cfg.data.path, "data.path"), (cfg.data.val_path, "data.val_path")):
        if value:
            data_source(value, setting)
    if cfg.data.tokenizer:
        tokenizer_file(cfg.data.tokenizer)


# -- the launcher's end and signals before the first step ---------------------------------------

LAUNCHER_GONE_EXIT = 1  # read by whoever reaps the orphan (a scheduler's step daemon, a subreaper)
_watching: list[threading.Thread] = []


def launched_by() -> str | None:
    """'torchrun' or 'accelerate launch' when one of them started this process, else None.
    accelerate's multi-process launch runs torchrun's agent in its own process (TORCHELASTIC_*);
    its one-process launch sets ACCELERATE_MIXED_PRECISION, as it does for every process."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return "accelerate launch"
    return None


def exit_with_launcher(interval_s: float = 0.5) -> None:
    """Under a launcher, end this process with one line within interval_s of the launcher's
    death. A `kill -9` of torchrun or accelerate leaves its ranks running (the launcher has no
    chance to stop them), training on and holding the devices and the run dir's lock.

    A thread watches the parent pid (an orphan is handed to another parent). Not
    prctl(PR_SET_PDEATHSIG): its signal is handled by Python on the main thread only, which may
    sit in a long C call (a collective, a kernel) for as long as the thread would have waited;
    the thread runs whenever the main thread releases the GIL, as torch's kernels and collectives
    do. os._exit, not an exception: the main thread may be anywhere. A checkpoint save in flight
    is abandoned in its step-N.tmp directory, which is never published (no `latest` points to
    it), and the kernel drops the run dir's flock with the process. Without a launcher (`python
    recipes/llama.py` under nohup, say) the parent's end is no reason to stop."""
    launcher = launched_by()
    if launcher is None or _watching:
        return
    parent = os.getppid()
    rank = os.environ.get("RANK", "0")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        try:
            print(
                f"error: rank {rank}: its launcher ({launcher}, pid {parent}) is gone, so this "
                "rank stops now: nothing is saved after the newest checkpoint; relaunch with "
                "--checkpoint.resume auto",
                file=sys.stderr,
                flush=True,
            )
        except OSError:  # the launcher held the only reader of our stderr
            pass
        os._exit(LAUNCHER_GONE_EXIT)

    thread = threading.Thread(target=watch, name="hybrid2d-launcher-watch", daemon=True)
    thread.start()
    _watching.append(thread)


def preemption_signals() -> tuple[signal.Signals, ...]:
    """SIGUSR1 and SIGINT always. SIGTERM too, unless the launcher restarts failed workers
    (torchrun --max_restarts > 0): its agent stops the surviving ranks with SIGTERM after a
    failure and restarts them, which must not be mistaken for a preemption."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        return (signal.SIGINT, signal.SIGUSR1)
    return (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class PreemptedAtStartUp(BaseException):
    """A preemption signal came before the first step: there is nothing to save, so start-up
    stops where it is. A BaseException, as KeyboardInterrupt is, so no `except Exception` on the
    way swallows it."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        super().__init__(
            f"{self.signal_name} before the first step: stopped, nothing was trained or saved; "
            "relaunch the same command"
        )


_before_start_up: dict[int, object] = {}  # signal -> the handler stop_start_up replaced


def _stop_start_up(signum, frame) -> None:
    for sig in _before_start_up:  # stopping already: a second signal must not interrupt that
        signal.signal(sig, signal.SIG_IGN)
    raise PreemptedAtStartUp(signum)


def stop_start_up_on_signals() -> None:
    """Until the run's Preemption takes over (before the first step), a preemption signal
    (SIGTERM, SIGUSR1; Ctrl-C is KeyboardInterrupt already) raises PreemptedAtStartUp: the run
    exits at once with one line and the preemption's exit code, instead of dying of the signal
    with a traceback from each rank's launcher. Main thread only (Python's rule for handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in preemption_signals():
        if sig != signal.SIGINT and signal.getsignal(sig) is not _stop_start_up:
            _before_start_up[sig] = signal.signal(sig, _stop_start_up)


def end_start_up() -> None:
    """Put back the handlers stop_start_up_on_signals replaced that are still in place (a
    start-up that ended without training: a refused setting, --help, a test calling main)."""
    for sig, previous in list(_before_start_up.items()):
        if signal.getsignal(sig) in (_stop_start_up, signal.SIG_IGN):
            signal.signal(sig, previous)
        del _before_start_up[sig]


def handler_before_start_up(sig: int, handler):
    """The handler to restore in place of `handler`: if it is start-up's, the one start-up
    replaced (a signal after the run must not claim to come before its first step)."""
    if handler is _stop_start_up:
        return _before_start_up.pop(sig, signal.SIG_DFL)
    return handler
