"""Sizes and CRC-32s of a checkpoint's files, so a truncated or corrupted checkpoint is reported
as such before anything is loaded from it.

DCP itself keeps no checksums: a flipped byte inside a tensor would load silently. The ranks that
save also hash (each a share of the files, read back from the page cache), rank 0 writes
`checksums.json`, and a resume checks the sizes on every rank and the hashes shared out across
the ranks. Checkpoints written by other tools (no checksums.json) skip this check.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from hybrid2d.checkpoint.layout import CHECKSUMS, METADATA, write_text_atomic

_CHUNK = 16 << 20


def checkpoint_files(path: Path) -> list[str]:
    """The DCP files of a checkpoint directory (data files and .metadata), sorted."""
    return sorted(p.name for p in path.iterdir() if p.suffix == ".distcp" or p.name == METADATA)


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files this rank hashes: every world-th one."""
    return names[rank::world]


def describe(path: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """{name: {"size", "crc32"}} of the given files."""
    return {n: {"size": (path / n).stat().st_size, "crc32": crc32_file(path / n)} for n in names}


def write(path: Path, entries: dict[str, dict[str, int]]) -> None:
    checksums = {"algorithm": "crc32", "files": dict(sorted(entries.items()))}
    write_text_atomic(path / CHECKSUMS, json.dumps(checksums, indent=1))


def read(path: Path) -> dict[str, dict[str, int]] | None:
    """The recorded files, None if the checkpoint has no checksums.json; ValueError if the file
    itself is damaged."""
    f = path / CHECKSUMS
    if not f.is_file():
        return None
    try:
        files = json.loads(f.read_text())["files"]
        return {
            str(k): {"size": int(v["size"]), "crc32": int(v["crc32"])} for k, v in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{CHECKSUMS} is unreadable ({type(e).__name__}: {e})") from None


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with a checkpoint's files, or None: every file's size (stat only) and the
    CRC-32s of this rank's share. None also when there is no checksums.json to check against."""
    try:
        recorded = read(path)
    except ValueError as e:
        return str(e)
    if recorded is None:
        return None
    for name, want in recorded.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} is {size} bytes, {want['size']} when saved (truncated or overwritten)"
    for name in share(sorted(recorded), rank, world):  # sizes first: a stat is cheap
        crc, want = crc32_file(path / name), recorded[name]["crc32"]
        if crc != want:
            return f"{name} has CRC-32 {crc:08x}, {want:08x} when saved (corrupted)"
    return None
