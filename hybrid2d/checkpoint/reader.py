"""Reading a DCP checkpoint in one process, without a process group: its metadata, its config,
shape checks against a model, and its model tensors one at a time.

Every rank of a resuming job runs the checks here before any collective, and the tools (export,
generate) read the model through `iter_model_tensors`, which holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hybrid2d.checkpoint import layout
from hybrid2d.config import ConfigError, JobConfig, ModelConfig
from hybrid2d.models.llama import Llama

MODEL = "model"  # top-level keys of the saved state (shared with the HF converter)
OPTIMIZER = "optimizer"
TRAINER = "trainer"


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of a step directory; ConfigError if it is missing or unreadable."""
    f = path / layout.METADATA
    if not f.is_file():
        raise ConfigError(f"{path} is not a DCP checkpoint directory: it has no {layout.METADATA}")
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling garbage raises anything
        raise ConfigError(
            f"checkpoint {path}: {layout.METADATA} cannot be read ({first_line(e)}); the "
            "checkpoint is truncated or corrupted, use an earlier one"
        ) from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise ConfigError(f"checkpoint {path}: {layout.METADATA} is not DCP metadata (corrupted)")
    return meta


def read_config(path: Path) -> JobConfig | None:
    """The JobConfig saved with the checkpoint, None if it has no config.json."""
    f = path / layout.CONFIG
    if not f.is_file():
        return None
    try:
        return JobConfig.from_dict(json.loads(f.read_text()))
    except (ValueError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"checkpoint {path}: {layout.CONFIG} is unreadable ({first_line(e)})"
        ) from None


def model_entries(meta: Metadata) -> dict[str, TensorStorageMetadata]:
    """HF key -> tensor metadata of the checkpoint's model tensors ("model.<HF key>" in DCP)."""
    prefix = MODEL + "."
    return {
        k[len(prefix) :]: v
        for k, v in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def is_training_checkpoint(meta: Metadata) -> bool:
    return f"{TRAINER}.step" in meta.state_dict_metadata


def expected_model_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every state-dict tensor of a Llama of this shape; no memory."""

    with torch.device("meta"):
        model = Llama(m)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _config_diff(saved: JobConfig | None, mine: ModelConfig) -> str:
    if saved is None:
        return ""
    diffs = [
        f"model.{f.name}={getattr(saved.model, f.name)!r} there, {getattr(mine, f.name)!r} here"
        for f in dataclasses.fields(ModelConfig)
        if f.name != "name" and getattr(saved.model, f.name) != getattr(mine, f.name)
    ]
    return f" ({'; '.join(diffs[:4])})" if diffs else ""


def check_model_shapes(
    path: Path,
    meta: Metadata,
    expected: dict[str, tuple[int, ...]],
    model_cfg: ModelConfig | None = None,
) -> None:
    """ConfigError naming the first model tensor whose presence or shape differs."""
    saved = model_entries(meta)
    hint = _config_diff(read_config(path), model_cfg) if model_cfg is not None else ""
    for key, shape in expected.items():
        if key not in saved:
            raise ConfigError(
                f"checkpoint {path} does not fit this model: it has no tensor {key} (shape "
                f"{list(shape)} here){hint}"
            )
        got = tuple(saved[key].size)
        if got != shape:
            raise ConfigError(
                f"checkpoint {path} does not fit this model: {key} has shape {list(got)} in the "
                f"checkpoint but {list(shape)} here{hint}"
            )
    extra = [k for k in saved if k not in expected]
    if extra:
        raise ConfigError(
            f"checkpoint {path} does not fit this model: it has {extra[0]} (shape "
            f"{list(saved[extra[0]].size)}), which this model lacks{hint}"
        )


class _Reader(FileSystemReader):
    """A FileSystemReader that reuses already-read metadata instead of unpickling it per call."""

    def __init__(self, path: Path, meta: Metadata):
        super().__init__(str(path))
        self._meta = meta

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._meta


def iter_model_tensors(
    path: Path,
    meta: Metadata | None = None,
    keys: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, full tensor) for each model tensor, loaded one at a time in one process.

    Each tensor is assembled from whatever shards the saving ranks wrote (DCP reads only the
    byte ranges it needs), so the caller never holds more than the tensor it is looking at.
    """
    meta = meta if meta is not None else read_metadata(path)
    entries = model_entries(meta)
    reader = _Reader(path, meta)
    for key in entries if keys is None else keys:
        md = entries[key]
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({MODEL: {key: tensor}}, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise ConfigError(
                f"checkpoint {path}: {key} cannot be read ({cause(e)}); the checkpoint is "
                "truncated or corrupted"
            ) from None
        yield key, tensor if dtype is None else tensor.to(dtype)


def cause(e: BaseException) -> str:
    """The underlying error of a DCP CheckpointException (which wraps per-rank failures)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, BaseException):
            return first_line(inner)
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return first_line(inner[0])
    return first_line(e)


def load_model_state(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint as full tensors (one copy of the model)."""
    return dict(iter_model_tensors(path, dtype=dtype))
