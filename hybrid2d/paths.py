"""The settings that name a file or directory, checked with the file system alone: each check is
the one owner of its message. Plain Python, so the recipe runs them before torch loads (a missing
path fails in a fraction of a second, not after 10 s of imports), and the code that reads the
file later calls the same check, so a run started another way says the same line."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
from dataclasses import dataclass

from hybrid2d.errors import ConfigError

# The files a corpus is read from (data/corpus.py reads each kind).
SUFFIXES = (".txt", ".jsonl", ".parquet")
DATA_HINT = f"use a {'/'.join(SUFFIXES)} file, a directory of them, or '' for the built-in corpus"
# A Hugging Face `datasets` directory written by save_to_disk holds one of these (a Dataset's
# state.json, a DatasetDict's dataset_dict.json with a directory per split).
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
HF_PREFIX = "hf:"
HF_SPELLING = (
    "hf:NAME[:CONFIG][@SPLIT][#REVISION] (a Hugging Face Hub dataset, e.g. "
    "hf:HuggingFaceFW/fineweb-edu:sample-10BT@train) or hf:/DIR[@SPLIT] (a local directory of "
    "data files)"
)
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")
_SPLIT = re.compile(r"[\w.-]+")
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


def data_source(value: str, setting: str = "data.path") -> pathlib.Path | None:
    """A data path (`setting` names the option it came from) with ~ expanded, once it exists and,
    as a file, has a suffix the corpus reads; a directory's files are the corpus' to list. An
    hf: value is checked by hf_source (None for a Hub dataset: it has no local path)."""
    if value.startswith(HF_PREFIX):
        spec = hf_source(value, setting)
        return pathlib.Path(spec.name) if spec.local else None
    path = pathlib.Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{setting}={value!r} does not exist; {DATA_HINT}")
    if path.is_file() and path.suffix not in SUFFIXES:
        raise ConfigError(
            f"{setting}={value!r} has unsupported suffix {path.suffix!r}; {DATA_HINT}"
        )
    if saved_dataset(path):
        _saved_dataset_split(path, value, setting)
        _need_datasets(value, setting, "a Hugging Face datasets directory (save_to_disk)")
    return path


def saved_dataset(path: pathlib.Path) -> bool:
    """True for a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_FILES)


def _saved_dataset_split(path: pathlib.Path, value: str, setting: str) -> None:
    """A DatasetDict of several splits is refused: reading all of them would train on the test
    split too, and picking one silently would hide the others; its split directories are
    Datasets of their own."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return
    try:
        splits = json.loads(index.read_text())["splits"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{setting}={value!r}: {index} is not a DatasetDict's index (JSON with 'splits'); "
            "save the dataset again with save_to_disk"
        ) from None
    if len(splits) > 1:
        raise ConfigError(
            f"{setting}={value!r} is a DatasetDict of splits {splits}; point {setting} at the "
            f"split to read, e.g. {path / splits[0]}"
        )


def _need_datasets(value: str, setting: str, what: str) -> None:
    """The datasets package is optional: a source that needs it says so before anything runs
    (find_spec looks for the package without importing it)."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(
            f"{setting}={value!r} is {what}, which needs the datasets package: "
            "pip install datasets (or pip install 'hybrid2d[hf]')"
        )


@dataclass(frozen=True)
class HFSource:
    """What an hf: data path names: the arguments of datasets.load_dataset(streaming=True)."""

    name: str  # a Hub dataset id (owner/name), or an absolute local directory of data files
    config: str  # "" for the dataset's default configuration
    split: str
    revision: str  # "" for the Hub's default branch (main)
    local: bool

    def identity(self) -> str:
        """What a cache key knows of a Hub dataset (a local one adds its files' sizes and
        mtimes): without a revision, a dataset changed on the Hub has the same identity."""
        return f"hf:{self.name}:{self.config}@{self.split}#{self.revision}"


def hf_source(value: str, setting: str = "data.path") -> HFSource:
    """An hf: data path parsed (its local directory checked to exist), or one line saying how it
    is written. A local directory starts with / ~ or . (a relative owner/name is a Hub id);
    it takes no :CONFIG, since a path may hold ':'."""
    rest, hashed, revision = value[len(HF_PREFIX) :].partition("#")
    local = rest.startswith(("/", "~", "."))
    head, at, tail = rest.rpartition("@")
    split = "train"
    if at and _SPLIT.fullmatch(tail):
        rest, split = head, tail
    elif at and not local:  # a local path may hold '@'; a Hub id may not
        rest = ""
    config = ""
    if not local:
        rest, colon, config = rest.partition(":")
        if colon and not config:
            rest = ""
    if not rest or (hashed and not revision) or not (local or _HUB_NAME.fullmatch(rest)):
        raise ConfigError(f"{setting}={value!r} is not {HF_SPELLING}")
    if local:
        if revision:
            raise ConfigError(
                f"{setting}={value!r}: a local directory has no revision; drop #{revision}"
            )
        path = pathlib.Path(rest).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(
                f"{setting}={value!r}: {path} is not a directory; hf:/DIR names a local "
                "directory of data files (.parquet, .jsonl, .csv, .txt) that "
                "datasets.load_dataset reads"
            )
        if saved_dataset(path):
            raise ConfigError(
                f"{setting}={value!r}: {path} was written by save_to_disk, which load_dataset "
                f"does not read; set {setting} to {path} (without hf:)"
            )
        rest = str(path)
    _need_datasets(value, setting, "a Hugging Face dataset read by datasets.load_dataset")
    return HFSource(rest, config, split, revision, local)


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
