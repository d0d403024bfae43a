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
