"""The settings that name a file or directory, checked with the file system alone: each check is
the one owner of its message. Plain Python, so the recipe runs them before torch loads (a missing
path fails in a fraction of a second, not after 10 s of imports), and the code that reads the
file later calls the same check, so a run started another way says the same line."""

from __future__ import annotations

import json
import os
import pathlib

from hybrid2d.errors import ConfigError

# The files a corpus is read from (data/corpus.py reads each kind).
SUFFIXES = (".txt", ".jsonl", ".parquet")
DATA_HINT = f"use a {'/'.join(SUFFIXES)} file, a directory of them, or '' for the built-in corpus"
# What each kind of checkpoint.init_from names.
INIT_FROM_DIRS = {"hf": "a Hugging Face model dir", "dcp": "a DCP checkpoint directory"}


def split_init_from(spec: str) -> tuple[str, str]:
    """checkpoint.init_from 'hf:PATH' or 'dcp:PATH' -> (kind, PATH with ~ expanded)."""
    kind, sep, path = spec.partition(":")
    if not sep or kind not in INIT_FROM_DIRS or not path:
        raise ConfigError(
            f"checkpoint.init_from={spec!r} is not 'hf:PATH' (a Hugging Face model directory) "
            "or 'dcp:PATH' (a DCP checkpoint directory)"
        )
    return kind, os.path.expanduser(path)


def init_from_dir(spec: str) -> None:
    """checkpoint.init_from names a directory (what it holds is the checkpoint readers' to say)."""
    kind, path = split_init_from(spec)
    if not os.path.isdir(path):
        shown = path if kind == "hf" else pathlib.Path(path)  # as each kind's reader names it
        raise ConfigError(
            f"checkpoint.init_from={spec}: {shown} is not a directory (expected "
            f"{INIT_FROM_DIRS[kind]})"
        )


def resume_dir(setting: str) -> pathlib.Path:
    """A --checkpoint.resume PATH (not "" or "auto") with ~ expanded, once it is a directory."""
    p = pathlib.Path(setting).expanduser()
    name = "--checkpoint.resume"
    if not p.exists():
        raise ConfigError(
            f"{name}={setting!r}: {p} does not exist; pass a checkpoint step directory "
            "(runs/<run>/checkpoints/step-0000100), a run directory, or 'auto'"
        )
    if not p.is_dir():
        raise ConfigError(
            f"{name}={setting!r}: {p} is a file, not a checkpoint directory; pass a step "
            "directory (runs/<run>/checkpoints/step-0000100) or a run directory"
        )
    return p


def data_source(value: str, setting: str = "data.path") -> pathlib.Path:
    """A data path (`setting` names the option it came from) with ~ expanded, once it exists and,
    as a file, has a suffix the corpus reads; a directory's files are the corpus' to list."""
    path = pathlib.Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{setting}={value!r} does not exist; {DATA_HINT}")
    if path.is_file() and path.suffix not in SUFFIXES:
        raise ConfigError(
            f"{setting}={value!r} has unsupported suffix {path.suffix!r}; {DATA_HINT}"
        )
    return path


def tokenizer_file(setting: str) -> pathlib.Path:
    """data.tokenizer -> its tokenizer.json (a directory stands for the one it holds)."""
    path = pathlib.Path(setting).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer={setting!r}: {path} does not exist; use a tokenizer.json"
            ", a Hugging Face model directory holding one, or '' to train a BPE"
        )
    return path


def read_profile(path: str) -> dict:
    """The JSON object of a hardware profile file (tools/plan.py --calibrate --out FILE.json)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"--hardware {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--hardware {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware {path}: expected a JSON object")
    return data


def plan_hardware_file(setting: str) -> None:
    """parallel.plan_hardware, when it names a profile file (not a preset), holds a JSON object
    (its fields are the planner's to check); the line names the setting as
    planner.launch.planner_profile does."""
    if setting.endswith(".json"):
        try:
            read_profile(setting)
        except ConfigError as e:
            raise ConfigError(f"parallel.plan_hardware={setting!r}: {e}") from None
