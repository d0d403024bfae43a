"""Safetensors files and Hugging Face checkpoint directories, read and written a tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range) and the raw row-major bytes. That is simple enough to read with plain `seek`/`readinto`
into a preallocated tensor, which gives two things the mmap-based `safe_open` does not:

- exact accounting of the bytes read from disk (`bytes_read`), and
- no mapped file pages in the resident set, so the converters' peak-memory figures are honest.

`read_slice` reads only the bytes of a rectangular block (one contiguous run per row when the
block is narrower than the tensor), which is what each rank needs for its shard of a TP x FSDP
parameter. Tests check the results against `safe_open(...).get_slice`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from hybrid2d.errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint on disk is missing, malformed or does not fit the model (one line)."""


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files besides the weights that make a HF model directory usable (tokenizer, generation).
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    start: int = 0  # absolute byte offset of the data in the file


def load_json(path: str | os.PathLike, optional: bool = False):
    """The parsed JSON file; CheckpointError (one line) if it is unreadable or not valid JSON.
    optional: None instead, and for a file that holds no JSON object (a file that may be absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        if optional:
            return None
        raise CheckpointError(f"{path} is not a readable JSON file ({e})") from None
    return None if optional and not isinstance(data, dict) else data


def _read_exact(f, offset: int, out: memoryview, what: str) -> None:
    f.seek(offset)
    pos = 0
    while pos < len(out):
        n = f.readinto(out[pos:])
        if not n:
            raise CheckpointError(f"{what}: file ends early (truncated safetensors file?)")
        pos += n


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class SafetensorsFile(contextlib.AbstractContextManager):
    """One .safetensors file: header parsed on open, tensors read on demand without mmap."""

    def __init__(self, path: str):
        self.path = path
        self.bytes_read = 0
        try:
            self._f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist") from None
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(self._f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a malformed safetensors header ({e})") from None
        if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
            raise CheckpointError(f"{path} has a malformed safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        base = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            dtype = DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointError(
                    f"{path}: tensor {name} has dtype {entry.get('dtype')!r}; supported: "
                    f"{', '.join(DTYPES)}"
                )
            try:
                shape = tuple(int(s) for s in entry["shape"])
                lo, hi = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{path}: tensor {name}'s header entry has no valid shape and data_offsets "
                    "(a damaged safetensors file); download or export it again"
                ) from None
            info = TensorInfo(name, dtype, shape, base + lo)
            if hi - lo != info.nbytes or base + hi > size:
                raise CheckpointError(
                    f"{path}: tensor {name} byte range [{lo}, {hi}) does not fit shape "
                    f"{list(shape)} {entry['dtype']} or the file size {size}"
                )
            self.tensors[name] = info

    def close(self) -> None:
        self._f.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, name: str) -> torch.Tensor:
        shape = self.tensors[name].shape
        return self.read_slice(name, (0,) * len(shape), shape)

    def read_slice(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The block [offsets, offsets + sizes) of a tensor, reading only its bytes."""
        info = self.tensors[name]
        shape = info.shape
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(f"{name}: slice of rank {len(sizes)} for shape {list(shape)}")
        for o, s, n in zip(offsets, sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                raise ValueError(f"{name}: slice {list(offsets)}+{list(sizes)} outside {shape}")
        out, n = read_block(
            self._f, info.start, info.dtype, shape, offsets, sizes, f"{self.path}: {name}"
        )
        self.bytes_read += n
        return out


def read_block(
    f, start: int, dtype: torch.dtype, shape, offsets, sizes, what: str
) -> tuple[torch.Tensor, int]:
    """(block [offsets, offsets + sizes) of the row-major tensor whose element 0 is at byte
    `start` of f, bytes read): only the block's bytes, one contiguous run per row when the block
    is narrower than the tensor. Safetensors files and DCP's chunks both store tensors so."""
    out = torch.empty(tuple(sizes), dtype=dtype)
    if out.numel() == 0:
        return out, 0
    if not shape:  # a scalar: one run of one element
        shape, offsets, sizes = (1,), (0,), (1,)
    item = dtype.itemsize
    # Dims after `k` are taken whole, so each index over dims [:k] is one contiguous run of
    # sizes[k] * prod(shape[k+1:]) elements.
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    run = sizes[k] * strides[k] * item
    view = _byte_view(out)
    pos = 0
    outer = [range(offsets[i], offsets[i] + sizes[i]) for i in range(k)]
    for idx in itertools.product(*outer):
        elem = offsets[k] * strides[k] + sum(i * s for i, s in zip(idx, strides, strict=False))
        _read_exact(f, start + elem * item, view[pos : pos + run], what)
        pos += run
    return out, pos


class HFCheckpoint(contextlib.AbstractContextManager):
    """A Hugging Face model directory: config.json plus one or several safetensors files. Every
    problem is found on open and reported as one CheckpointError line."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a directory (expected a Hugging Face model dir)")
        entries = sorted(os.listdir(path))
        if not entries:
            raise CheckpointError(
                f"{path} is empty; expected config.json and model.safetensors or "
                f"{INDEX_NAME} with its shards"
            )
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(
                f"{path} has no config.json (found {', '.join(entries[:5])}); not a Hugging "
                "Face model directory"
            )
        self.config = load_json(config_path)
        files: dict[str, SafetensorsFile] = {}
        index_path = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index_path):
            index = load_json(index_path)
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                raise CheckpointError(f"{index_path} is malformed (no weight_map)")
            weight_map = index["weight_map"]
        elif os.path.isfile(os.path.join(path, SINGLE_NAME)):
            files[SINGLE_NAME] = SafetensorsFile(os.path.join(path, SINGLE_NAME))
            weight_map = dict.fromkeys(files[SINGLE_NAME].tensors, SINGLE_NAME)
        else:
            other = [e for e in entries if e.endswith((".bin", ".pt", ".pth", ".safetensors"))]
            found = f" (found {', '.join(other[:3])})" if other else ""
            raise CheckpointError(
                f"{path} has no {SINGLE_NAME} or {INDEX_NAME}{found}; only safetensors "
                "checkpoints are supported"
            )
        for name, fname in weight_map.items():
            if fname not in files:
                full = os.path.join(path, fname)
                if not os.path.isfile(full):
                    raise CheckpointError(
                        f"{INDEX_NAME} in {path} names shard {fname} (holding {name}), "
                        "which is missing"
                    )
                files[fname] = SafetensorsFile(full)
            if name not in files[fname].tensors:
                raise CheckpointError(
                    f"{INDEX_NAME} in {path} places {name} in {fname}, which does not hold it"
                )
        self.files = files
        self.tensors: dict[str, TensorInfo] = {
            name: files[fname].tensors[name] for name, fname in weight_map.items()
        }
        self._by_name = {name: files[fname] for name, fname in weight_map.items()}

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())

    def read(self, name: str) -> torch.Tensor:
        return self._by_name[name].read(name)

    def read_slice(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        return self._by_name[name].read_slice(name, offsets, sizes)

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __exit__(self, *exc) -> None:
        self.close()


# ---- writing ---------------------------------------------------------------------------------


def plan_shards(specs: Iterable[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Greedy size-capped shards in the given order; a tensor above the cap gets its own shard."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (size + spec.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_safetensors(
    path: str,
    specs: Sequence[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write one safetensors file, asking `produce` for each tensor only when it is written: the
    header comes from the specs, so at most one tensor is in memory at a time."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for s in specs:
        if s.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{s.name}: dtype {s.dtype} cannot be stored in safetensors")
        header[s.name] = {
            "dtype": DTYPE_NAMES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for s in specs:
            t = produce(s)
            if t.dtype != s.dtype or tuple(t.shape) != s.shape:
                raise CheckpointError(
                    f"{s.name}: got {t.dtype} {list(t.shape)}, expected {s.dtype} {list(s.shape)}"
                )
            t = t.detach().cpu().contiguous()
            f.write(_byte_view(t))
            del t
