"""hybrid2d.sizes.parse_size: the project's one reader of sizes like 80GB and 80GiB; the tools'
size flags (cli.positive_size) on top of it."""

import importlib.util

import pytest

from hybrid2d.cli import positive_size
from hybrid2d.errors import ConfigError
from hybrid2d.sizes import parse_size
from tests.launch import REPO


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


def test_a_size_flag_refuses_a_number_without_a_unit():
    """'--gpu-memory 24' was 24 bytes ('0 GiB each ... 0 fit'). A flag documented to take bytes
    (--max-shard-size, as Hugging Face's max_shard_size) keeps them."""
    with pytest.raises(ConfigError) as e:
        positive_size("24", "--gpu-memory")
    assert str(e.value) == (
        "--gpu-memory '24' has no unit: say 24GiB (24 x 2^30 bytes) or 24GB (24 x 10^9)"
    )
    for text in ("1e9", " 80 ", "0.5e3"):
        with pytest.raises(ConfigError, match="has no unit"):
            positive_size(text, "--device-memory")
    assert positive_size("24B", "--gpu-memory") == 24  # bytes, as said
    assert positive_size("1048576", "--max-shard-size", bare_bytes=True) == 2**20


@pytest.mark.parametrize(
    "name, argv, flag",
    [("plan", [], "--gpu-memory"), ("memory_report", ["--mesh", "2x2"], "--device-memory")],
)
def test_every_memory_flag_says_the_unit_is_missing(name, argv, flag, capsys):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    assert tool.main([*argv, flag, "80"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {flag} '80' has no unit: say 80GiB (80 x 2^30 bytes) or 80GB (80 x 10^9)"
    ]
