"""DCP's `.metadata` file is a pickle, and unpickling calls whatever the file names: a checkpoint
from someone else (`init_from dcp:`, `generate.py`, a resume, an export) could run their code
the moment it is opened. Here it is unpickled with an allow-list of what torch writes there
(the classes of torch.distributed.checkpoint.metadata, its filesystem's storage record, dtypes,
layouts, torch.Size, paths and plain builtin containers), and anything else is refused by name,
before a single object is built from it.

DCP reads tensors with torch.load(weights_only=True) already, but a resume's non-tensor state
(step, schedule, data position, optimizer hyper-parameters) with weights_only=False:
`SafeLoadPlanner` reads those with weights_only=True first (plain values, containers, tensors).
"""

from __future__ import annotations

import pickle
import typing

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = {
    name
    for name, obj in vars(dcp_metadata).items()
    if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
}
ALLOWED: dict[str, set[str]] = {
    dcp_metadata.__name__: _DCP_METADATA,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # and every dtype, layout and memory format (see _allowed)
    "torch.serialization": {"_get_layout"},  # a lookup of torch's layouts by name
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "complex", "slice", "range", "bytearray"},
}


class UntrustedPickle(pickle.UnpicklingError):
    """The pickle names something DCP metadata never holds (the message says what)."""


def _allowed(module: str, name: str) -> bool:
    if name in ALLOWED.get(module, ()):
        return True
    value = getattr(torch, name, None) if module == "torch" else None
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise UntrustedPickle(
                f"names {module}.{name}, which DCP metadata never holds: refused to unpickle "
                "it (unpickling can run code); this is not a checkpoint torch.distributed."
                "checkpoint wrote, or it was altered"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):  # DCP writes no persistent ids
        raise UntrustedPickle(f"holds a persistent id ({pid!r}), which DCP metadata never does")


def load_metadata(file: typing.BinaryIO) -> Metadata:
    """A DCP Metadata from an open .metadata file, unpickled through the allow-list."""
    return _Unpickler(file).load()


class MetadataReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-list; everything else is DCP's.

    read_metadata is DCP's own with pickle.load replaced; DCP has no public hook for the
    unpickler, so it uses the reader's `_get_metadata_path` and `fs` as DCP's does (move to
    such a hook if DCP grows one)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries must load with weights_only=True: each is
    read that way first, and only then handed to DCP's own load_bytes (which unpickles it in
    full; reading twice keeps to DCP's public planner API, and these entries are a few bytes)."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UntrustedPickle(
                f"its entry {read_item.dest_index.fqn} is not a plain value, container or "
                "tensor: refused to unpickle it (unpickling can run code)"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)
