"""Collectives of a real step (CommDebugMode) equal the analytic formula exactly."""

import json

import pytest

from hybrid2d.comm_report import analytic_step
from tests.launch import check_ok, run_ranks
from tests.reference import tiny_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dp,tp,micro", [(2, 2, 0), (2, 2, 2), (1, 2, 0), (2, 1, 0)])
def test_counts_and_bytes_equal_formula(tmp_path, dp, tp, micro):
    out = tmp_path / "comm.json"
    check_ok(run_ranks(dp * tp, ["tests/workers/comm.py", str(out), str(dp), str(tp), str(micro)]))
    measured = json.loads(out.read_text())
    cfg = tiny_config()
    local = cfg.train.global_batch // dp
    expected = analytic_step(
        cfg.model, dp, tp, local, cfg.train.seq_len, micro_batches=local // micro if micro else 1
    )
    assert measured["counts"] == {k: c for k, (c, _) in expected.items()}, measured
    assert measured["bytes"] == {k: b for k, (_, b) in expected.items()}, measured
