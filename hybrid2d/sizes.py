"""Byte sizes written by people: '80GB', '80GiB', '500MB', '1.5TiB', '1048576'.

The one size parser of the project (safetensors shard caps, --device-memory, ...). Decimal
units are powers of 1000 and binary units powers of 1024, as the SI/IEC names say and as
Hugging Face's `max_shard_size` reads them: 80GB is 80 x 10^9 bytes, 80GiB is 80 x 2^30.
Units are case-insensitive; a bare number (or a trailing B) is bytes. Unit-less letters such
as '80G' are refused because they are read both ways in the wild. The tools' size flags refuse
a bare number (`cli.positive_size`: '--gpu-memory 24' means 24GiB to a person, not 24 bytes)
unless their help says bytes (--max-shard-size, as Hugging Face's max_shard_size).
"""

from __future__ import annotations

import re
from decimal import Decimal

from hybrid2d.errors import ConfigError

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_EXAMPLES = "bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (of 1024)"


def unit_of(text: str) -> str | None:
    """The unit a size is written with, lowercased: 'gib' for '80GiB', 'b' for '24B', '' for a
    bare number; None when `text` is no size."""
    match = _SIZE.fullmatch(text)
    return match.group(2).lower() if match else None


def parse_size(text: str | int, what: str = "size", minimum: int = 1) -> int:
    """Bytes that `text` names, at least `minimum`; fractions of a byte are dropped.

    A ConfigError names `what` (the setting or flag, e.g. '--device-memory'), the text and
    what would work.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(2).lower() if match else None
        if unit not in UNITS:
            hint = (
                f"; say {match.group(1)}{unit.upper()}B (x 10^{3 * 'kmgt'.index(unit) + 3}) or "
                f"{match.group(1)}{unit.upper()}iB (x 2^{10 * 'kmgt'.index(unit) + 10})"
                if match and unit in ("k", "m", "g", "t")
                else ""
            )
            raise ConfigError(f"{what} {text!r} is not a size: use {_EXAMPLES}, e.g. 80GB{hint}")
        value = int(Decimal(match.group(1)) * UNITS[unit])  # the pattern lets only numbers in
    if value < minimum:
        raise ConfigError(f"{what} {text!r} is {value} bytes; it must be at least {minimum}")
    return value
