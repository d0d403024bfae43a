"""Shared-memory collectives (parallel.shm_collectives) equal gloo's, and fail loudly."""

import json
import os

import pytest

from tests.launch import check_ok, run_ranks


@pytest.mark.slow
def test_shm_collectives_equal_gloo_and_time_out(tmp_path):
    out = tmp_path / "shm.json"
    check_ok(run_ranks(3, ["tests/workers/shm.py", str(out)], timeout=180))
    report = json.loads(out.read_text())
    # 40 rounds x 7 collectives, each compared with gloo on the same inputs (3 ranks).
    assert report["checked"] == 40 * 7 + 1
    assert report["generations"] == 40 * 7  # all of them through shared memory
    assert report["fallback_untouched"]
    assert "group ranks [2] did not reach" in report["timeout"]
    assert 2.5 < report["timeout_after_s"] < 30
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("hybrid2d-")]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["on", "auto"])
def test_without_shared_memory_on_stops_and_auto_uses_gloo(tmp_path, setting):
    out = tmp_path / "r.json"
    check_ok(run_ranks(4, ["tests/workers/shm_unavailable.py", str(out), setting], timeout=180))
    results = json.loads(out.read_text())
    assert all(r["transports"] == 0 for r in results)
    if setting == "on":
        for r in results:
            assert r["error"].startswith("parallel.shm_collectives=on but shared memory is")
            assert "simulated: no /dev/shm" in r["error"] and "use auto" in r["error"]
    else:
        assert all("error" not in r for r in results)
        assert len({r["loss"] for r in results}) == 1


@pytest.mark.slow
def test_a_dead_peer_ends_the_wait_at_once(tmp_path):
    out = tmp_path / "dead.json"
    check_ok(run_ranks(3, ["tests/workers/shm.py", str(out), "dead"], timeout=120))
    report = json.loads(out.read_text())
    assert "exited during shared-memory collective 2" in report["error"]
    assert report["after_s"] < 5
