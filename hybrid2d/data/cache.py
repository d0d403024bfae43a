"""Cache keys and atomic writes for files that several processes may produce at once.

Writers put the bytes in a temporary file in the destination directory and `os.replace` it into
place, so a reader sees either no file or a complete one, never a half-written one, even when
two jobs race to fill the same cache entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import tempfile
from collections.abc import Iterator

import numpy as np

from hybrid2d.errors import ConfigError


def cache_key(*parts: object) -> str:
    """A short stable hash of the parts (their str())."""
    h = hashlib.sha256()
    for part in parts:
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def atomic_path(dest: pathlib.Path) -> Iterator[pathlib.Path]:
    """Yield a temporary path next to dest; on success it is renamed onto dest, else removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp_path = pathlib.Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o644)  # mkstemp makes it private; a cache is for everyone
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


def save_npy(dest: pathlib.Path, array: np.ndarray) -> None:
    with atomic_path(dest) as tmp, open(tmp, "wb") as f:  # np.save would append .npy to a name
        np.save(f, array)


def read_cached(path: pathlib.Path, load):
    """load(path) of a cache file; a damaged one (truncated, overwritten, not what was saved)
    is one ConfigError naming it: the cache is only ever rebuilt, never repaired."""
    try:
        return load(path)
    except Exception as e:  # np.load, json and the tokenizers library each raise their own
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"data cache file {path} is damaged ({first}); delete it and launch again, "
            "it is rebuilt from the data"
        ) from None


def must_build(path: pathlib.Path, build: bool, cache_dir: pathlib.Path, what: str) -> bool:
    """True if `path` is missing and this process builds it (`build`: the main process); to the
    others, which read it after the main process built it, a missing path is an error."""
    if path.exists():
        return False
    if not build:
        raise ConfigError(
            f"data.cache_dir={str(cache_dir)!r} has no {what} after the main process built it; "
            "use a cache_dir every process can see"
        )
    return True
