"""Reading a DCP checkpoint in one process, without a process group: its metadata, its config,
shape checks against a model, and its model tensors one at a time.

Every rank of a resuming job runs the checks here before any collective, and the tools (export,
generate) read the model through `iter_model_tensors`, which holds one tensor at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hybrid2d.checkpoint import layout
from hybrid2d.checkpoint.hf_safetensors import _byte_view, _read_exact, read_block
from hybrid2d.checkpoint.safe_metadata import MetadataReader, UntrustedPickle
from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.models.llama import Llama

MODEL = "model"  # top-level keys of the saved state (shared with the HF converter)
OPTIMIZER = "optimizer"
TRAINER = "trainer"


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


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


@contextlib.contextmanager
def as_config_error(what: str, advice: str) -> Iterator[None]:
    """Any error inside as one ConfigError line, `what (its cause); advice`: damaged files make
    unpickling and DCP raise anything (DCP's CheckpointException is a BaseException)."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        raise ConfigError(f"{what} ({cause(e)}); {advice}") from None


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of a checkpoint directory; ConfigError if it is missing or unreadable."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory (expected a DCP checkpoint directory)")
    if not (path / layout.METADATA).is_file():
        if any(p.suffix == ".distcp" for p in path.iterdir()):
            raise ConfigError(
                f"checkpoint {path} is damaged: it has .distcp data files but no "
                f"{layout.METADATA} (DCP writes it last: the save did not finish, or it was "
                "deleted); use an earlier checkpoint"
            )
        found = sorted(p.name for p in path.iterdir())[:5]
        raise ConfigError(
            f"{path} is not a DCP checkpoint directory: it has no {layout.METADATA} (it holds "
            f"{', '.join(found) or 'nothing'}); point at a DCP checkpoint directory, e.g. a "
            "training checkpoint's step directory"
        )
    what = f"checkpoint {path}: {layout.METADATA} cannot be read"
    refused = None
    with as_config_error(what, "the checkpoint is truncated or corrupted, use an earlier one"):
        try:
            meta = MetadataReader(str(path)).read_metadata()
        except UntrustedPickle as e:  # not damage: a file that would run code, said as such
            refused = e
    if refused is not None:
        raise ConfigError(f"checkpoint {path}: {layout.METADATA} {refused}")
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


def model_keys(meta: Metadata) -> dict[str, str]:
    """HF key -> DCP flattened key of the entries under "model" (planner_data says which top-level
    entry a key came from; without it, the "model." prefix does)."""
    mapping = meta.planner_data or {}
    out = {}
    for key in meta.state_dict_metadata:
        parts = mapping.get(key)
        if parts is not None:
            if len(parts) == 2 and parts[0] == MODEL:
                out[parts[1]] = key
        elif key.startswith(MODEL + "."):
            out[key[len(MODEL) + 1 :]] = key
    return out


def model_entries(meta: Metadata, path: Path) -> dict[str, TensorStorageMetadata]:
    """HF key -> tensor metadata of the model tensors; ConfigError if there are none."""
    entries = {name: meta.state_dict_metadata[key] for name, key in model_keys(meta).items()}
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    if not tensors:
        raise ConfigError(
            f"checkpoint {path} has no '{MODEL}' entry; expected one saved as "
            "{'model': {<HF names>: tensors}, ...}"
        )
    return tensors


def expected_model_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every state-dict tensor of a model of this shape and family
    (the model built on the meta device: no memory)."""
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
    saved = model_entries(meta, path)
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


class _Reader(MetadataReader):
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
    entries = model_entries(meta, path)
    reader = _Reader(path, meta)
    for key in entries if keys is None else keys:
        md = entries[key]
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        what = f"checkpoint {path}: {key} cannot be read"
        with as_config_error(what, "the checkpoint is truncated or corrupted"):
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({MODEL: {key: tensor}}, storage_reader=reader, no_dist=True)
        yield key, tensor if dtype is None else tensor.to(dtype)
        del tensor  # before the next one is allocated: one tensor at a time


# ---- reading only a block of a saved tensor ---------------------------------------------------
#
# FileSystemWriter stores each chunk of a tensor as a torch.save archive at a byte range of a
# .distcp file (DCP's metadata says where: storage_data[MetadataIndex(fqn, chunk offsets)]).
# FileSystemReader reads the whole range and narrows it in memory; `saved_tensor` instead finds
# the tensor's dtype, shape, strides and where its bytes start, and `read_saved_block` reads only
# the bytes of the wanted block (one run per row).


class _Window(io.RawIOBase):
    """A read-only file-like view of bytes [offset, offset + length) of an open file."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._off, self._n, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self._n + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        k = max(0, min(len(b), self._n - self._pos))
        self._f.seek(self._off + self._pos)
        data = self._f.read(k)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def saved_tensor(f, offset: int, length: int, where: str) -> tuple[int, torch.Tensor]:
    """(byte offset in f of element 0, a meta tensor with the dtype, shape and strides) of the
    torch.save archive at bytes [offset, offset + length) of file f. Loading onto the meta device
    parses only the archive's small pickle (weights_only: no arbitrary globals) and notes where
    the storage's bytes start without reading them."""
    with as_config_error(f"{where} cannot be read", "it is truncated or corrupted"):
        t = torch.load(_Window(f, offset, length), map_location="meta", weights_only=True)
        data = t.untyped_storage()._checkpoint_offset  # torch.load sets it for meta loads
    return offset + data + t.storage_offset() * t.dtype.itemsize, t


def read_saved_block(
    f, start: int, t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], where: str
) -> tuple[torch.Tensor, int]:
    """(block [offsets, offsets + sizes) of a saved tensor, bytes read from the file), given
    what saved_tensor returned for it."""
    shape, stride = tuple(t.shape), t.stride()
    if t.is_contiguous() or t.numel() <= 1:
        return read_block(f, start, t.dtype, shape, offsets, sizes, where)
    # Not row-major (DCP writes contiguous chunks; be safe anyway): read it whole.
    span = sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
    raw = torch.empty(span, dtype=t.dtype)
    _read_exact(f, start, _byte_view(raw), where)
    block = raw.as_strided(shape, stride)[
        tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    ]
    return block.clone(memory_format=torch.contiguous_format), span * t.dtype.itemsize
