"""Where checkpoints live on disk and which one is current. Plain files, no torch.

    <run_dir>/checkpoints/
        step-0000010/        a complete DCP directory (.metadata, __<rank>_<n>.distcp, config.json,
                             tokenizer.json, checksums.json)
        step-0000020.tmp/    a save in progress, or one that never finished (ignored, cleaned up)
        latest               text file: the name of the newest complete step directory

A save writes into `step-N.tmp`, rank 0 renames it to `step-N` once every rank has finished, and
only then replaces `latest` (write a temporary file, `os.replace` it). So whatever moment a run
dies at, `latest` names a complete checkpoint, and a directory named `step-N` is complete.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
from pathlib import Path

from hybrid2d.errors import ConfigError
from hybrid2d.paths import resume_dir

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
METADATA = ".metadata"  # written by DCP's FileSystemWriter, last
CONFIG = "config.json"  # the run's JobConfig.to_dict()
TOKENIZER = "tokenizer.json"
CHECKSUMS = "checksums.json"
_STEP_RE = re.compile(r"^step-(\d{7,})$")


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def step_of(path: str | os.PathLike) -> int | None:
    """The step of a `step-NNNNNNN` directory name, None for anything else."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def tmp_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / (step_name(step) + TMP_SUFFIX)


def final_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_name(step)


def complete_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete (renamed) checkpoints in a checkpoints directory, ascending."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    steps = [step_of(p) for p in d.iterdir() if p.is_dir()]
    return sorted(s for s in steps if s is not None)


def read_latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names; without a `latest` file, the newest complete step directory
    (a run killed between the rename and the pointer update leaves that state)."""
    d = Path(ckpt_dir)
    pointer = d / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        target = d / name
        if step_of(name) is None or not target.is_dir():
            raise ConfigError(
                f"{pointer} names {name!r}, which is not a checkpoint directory there; "
                "pass a step directory with --checkpoint.resume PATH"
            )
        return target
    steps = complete_steps(d)
    return d / step_name(steps[-1]) if steps else None


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (temporary file, fsync, os.replace)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make renames in `path` durable; skipped where a directory cannot be opened or synced."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(run_dir: str | os.PathLike, step: int) -> Path:
    """Rank 0, after every rank finished writing: rename step-N.tmp -> step-N, then point
    `latest` at it. Returns the final directory."""
    tmp, final = tmp_dir(run_dir, step), final_dir(run_dir, step)
    if final.exists():
        # Left by an earlier run in this directory that got past the rename but was superseded
        # (it resumed from an older checkpoint). Move it aside so the rename stays one step.
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    write_text_atomic(final.parent / LATEST, final.name + "\n")
    fsync_dir(final.parent)
    return final


def apply_retention(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints, and leftover `.tmp`/`.old`
    directories of saves that never finished. Call only when no save is in flight."""
    d = checkpoints_dir(run_dir)
    steps = complete_steps(d)
    removed = [d / step_name(s) for s in steps[: max(0, len(steps) - keep_last)]]
    for p in d.iterdir() if d.is_dir() else []:
        if p.is_dir() and p.name.endswith((TMP_SUFFIX, ".old")):
            removed.append(p)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def resolve(setting: str) -> Path:
    """A user's --checkpoint.resume PATH (a step directory, a checkpoints directory or a run
    directory) -> the step directory to load. ConfigError if there is none."""
    return resolve_dir(resume_dir(setting), "--checkpoint.resume", setting)


def resolve_dir(p: Path, name: str, setting: str) -> Path:
    if p.name.endswith(TMP_SUFFIX):
        raise ConfigError(
            f"{name}={setting!r}: {p} is an unfinished save (a '{TMP_SUFFIX}' directory is "
            "renamed only once every rank wrote its part); use the checkpoint `latest` names"
        )
    if (p / METADATA).is_file():
        return p
    for ckpt_dir in (p, p / CHECKPOINTS):
        latest = read_latest(ckpt_dir)
        if latest is not None:
            return latest
    found = sorted(x.name for x in p.iterdir())[:5]
    raise ConfigError(
        f"{name}={setting!r}: {p} is not a checkpoint directory (no {METADATA}, no "
        f"{CHECKPOINTS}/{LATEST}; it holds {found or 'nothing'}); pass a step directory such as "
        "runs/<run>/checkpoints/step-0000100"
    )


def find_run_to_resume(run_dir_template: str, recipe: str) -> str | None:
    """For --checkpoint.resume auto: the newest existing run directory matching the run-dir
    template (its {time} as a wildcard) that holds a checkpoint, or None."""
    pattern = run_dir_template.format(recipe=glob.escape(recipe), time="*")
    runs = sorted(glob.glob(pattern), key=lambda p: (os.path.getmtime(p), p), reverse=True)
    return next((run for run in runs if holds_checkpoint(run)), None)


def holds_checkpoint(run_dir: str | os.PathLike) -> bool:
    """Whether a run directory holds a checkpoint: a `latest` pointer or a complete step."""
    d = checkpoints_dir(run_dir)
    return (d / LATEST).is_file() or bool(complete_steps(d))


def latest_in_run(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from in this run directory (`auto`), or None."""
    return read_latest(checkpoints_dir(run_dir))
