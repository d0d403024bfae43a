"""Shutdown frees the process groups: no gloo thread may run into interpreter exit, where one
freeing a tensor aborts the process after a good run (see mesh._free_process_groups)."""

import json

import pytest

from tests.launch import check_ok, run_ranks

pytestmark = pytest.mark.slow


def test_no_thread_outlives_a_run(tmp_path):
    results = run_ranks(
        4,
        [
            "tests/workers/threads_after_run.py",
            str(tmp_path / "run"),
            str(tmp_path / "cache"),
            "2",
            "2",
        ],
    )
    check_ok(results)
    for rank, r in enumerate(results):
        counts = json.loads(r.stdout.strip().splitlines()[-1])
        assert counts["after"] == counts["before"], (rank, counts)
