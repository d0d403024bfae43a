"""A non-finite step on a 2x2 mesh: a finite loss whose gradient norm is not finite (one inf
gradient element on one rank) is handled like a non-finite loss; `skip` leaves every parameter
and every optimizer state tensor bit for bit as it was, `stop` raises on every rank before the
update."""

import json
import math

import pytest

from tests.launch import check_ok, run_ranks

pytestmark = pytest.mark.slow


def run(tmp_path, what, mode):
    out = tmp_path / f"{what}-{mode}.json"
    check_ok(run_ranks(4, ["tests/workers/paths_nonfinite.py", str(out), "2", "2", what, mode]))
    return json.loads(out.read_text())


@pytest.mark.parametrize("what", ["grad", "loss"])
def test_skip_leaves_parameters_and_optimizer_state_bit_identical(tmp_path, what):
    got = run(tmp_path, what, "skip")
    assert got["errors"] == [None] * 4
    for per_rank in got["results"]:  # every rank took the same branch at every step
        assert [r["skip"] for r in per_rank] == [False, False, True, False], per_rank
    bad = got["results"][0][2]
    if what == "grad":
        assert math.isfinite(bad["loss"]) and not math.isfinite(bad["norm"]), bad
    else:
        assert not math.isfinite(bad["loss"]), bad
    assert got["state_entries"] > 0  # AdamW moments and step counts exist before step 3
    assert got["changed"] == [] and got["state_changed"] == [], got
    assert all(math.isfinite(r["loss"]) for r in got["results"][0][3:])


@pytest.mark.parametrize("what", ["grad", "loss"])
def test_stop_raises_on_every_rank_before_the_update(tmp_path, what):
    got = run(tmp_path, what, "stop")
    for error in got["errors"]:
        assert error is not None and error.startswith("step 3: ") and "not finite" in error
    assert [len(r) for r in got["results"]] == [2] * 4  # steps 1-2 done, 3 raised
    assert got["changed"] == [] and got["state_changed"] == [], got
