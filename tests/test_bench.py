"""The benchmark's correctness parts: every kind starts from the same weights and batches."""

import json
import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.slow


def test_kinds_start_from_the_same_weights(tmp_path):
    out = tmp_path / "bench.json"
    small = [
        "--dim",
        "64",
        "--layers",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "128",
        "--vocab",
        "512",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "tools/bench.py",
            "--mesh",
            "2x2",
            "--repeats",
            "1",
            "--steps",
            "2",
            "--warmup",
            "0",
            *small,
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "hybrid2d / transformers tokens/s" in proc.stdout  # the table was printed
    kinds = json.loads(out.read_text())["2x2"]["kinds"]
    first = {k: v["first_loss"] for k, v in kinds.items()}
    assert first["hybrid2d"] == pytest.approx(first["transformers"], abs=1e-4)
    assert first["hybrid2d"] == pytest.approx(first["single"], abs=1e-4)
