"""hybrid2d.sizes.parse_size: the project's one reader of sizes like 80GB and 80GiB."""

import pytest

from hybrid2d.errors import ConfigError
from hybrid2d.sizes import parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GB", 80 * 10**9),
        ("80gb", 80 * 10**9),
        ("80 GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("5GB", 5_000_000_000),
        ("500MB", 500 * 10**6),
        ("512MiB", 2**29),
        ("100KB", 100_000),
        ("4KiB", 4096),
        ("2TB", 2 * 10**12),
        ("1.5TiB", 3 * 2**39),
        ("0.5GiB", 2**29),
        ("1048576", 2**20),
        ("1048576B", 2**20),
        ("1e9", 10**9),
        (4096, 4096),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["lots", "80G", "80g", "5 GBs", "-1GB", "GB", "", "1..5GB", "80XB"]
)
def test_bad_sizes_are_one_error_naming_the_flag(text):
    with pytest.raises(ConfigError) as e:
        parse_size(text, "--device-memory")
    msg = str(e.value)
    assert msg.startswith(f"--device-memory {text!r}") and "\n" not in msg
    assert "GB" in msg and "GiB" in msg


def test_unit_without_b_says_both_readings():
    with pytest.raises(ConfigError, match=r"say 80GB \(x 10\^9\) or 80GiB \(x 2\^30\)"):
        parse_size("80G", "--device-memory")


def test_minimum():
    assert parse_size("0", minimum=0) == 0
    with pytest.raises(ConfigError, match="--max-shard-size '0' is 0 bytes; it must be at least 1"):
        parse_size("0", "--max-shard-size")
