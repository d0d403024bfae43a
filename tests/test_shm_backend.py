"""The hybrid2d_shm process-group backend: shared-memory collectives behind torch.distributed.

The multi-process runs compare against plain gloo groups on the same inputs (nobody here wrote
gloo), check the failure modes (desynchronised collectives, dead and late peers, ranks killed
during set-up) and the parallel.shm_collectives policy.
"""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from hybrid2d import shm_backend
from hybrid2d.errors import ConfigError
from tests.launch import check_ok, run_ranks

WORKER = "tests/workers/shm_backend_worker.py"
FORKS = "tests/workers/shm_backend_forks.py"

needs_shm = pytest.mark.skipif(
    shm_backend.unavailable_reason() is not None,
    reason=f"shared memory unavailable: {shm_backend.unavailable_reason()}",
)


def test_register_is_idempotent():
    shm_backend.register()
    shm_backend.register()
    assert getattr(dist.Backend, shm_backend.BACKEND.upper()) == shm_backend.BACKEND


def test_configure_checks_the_setting():
    try:
        shm_backend.configure("on")
        with pytest.raises(ConfigError, match=r"parallel.shm_collectives='yes' is not one of"):
            shm_backend.configure("yes")
    finally:
        shm_backend.configure("auto")


def test_no_group_is_no_shared_memory():
    assert not shm_backend.uses_shared_memory(object())
    assert shm_backend.collective_count(object()) == 0


def test_one_rank_group_names_itself_and_delegates(tmp_path):
    """torch reads a group's name and backend through the C++ virtuals the class overrides
    (getGroupName, getBackendName; no Python twins); a group of one rank has no segment and
    gloo serves every call, the shared-memory entry points included."""
    shm_backend.register()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    assert not dist.is_initialized()
    dist.init_process_group(f"cpu:{shm_backend.BACKEND}", store=store, rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, shm_backend.ShmProcessGroup)
        assert pg.name() == shm_backend.BACKEND and pg.group_desc == "default_pg"
        assert _resolve_process_group(pg.group_name) is pg  # how functional collectives find it
        assert shm_backend.fallback_reason() == "one rank"
        assert not shm_backend.uses_shared_memory() and shm_backend.collective_count() == 0
        t = torch.arange(4.0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = torch.empty(4)
        dist.all_gather_single(out, torch.arange(4.0))
        assert t.tolist() == out.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert (
            funcol.reduce_scatter_single(torch.ones(3), "sum", 0, pg).wait().tolist() == [1.0] * 3
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _report(tmp_path, name):
    with open(tmp_path / name) as f:
        return json.load(f)


@needs_shm
@pytest.mark.slow
def test_collectives_equal_gloo(tmp_path):
    """3 ranks: every shared-memory collective equals gloo's on the same inputs."""
    check_ok(run_ranks(3, [WORKER, "equal", str(tmp_path / "equal.json")], timeout=240))
    report = _report(tmp_path, "equal.json")
    rounds = report["rounds"]
    assert report["checked"] == 12 * rounds + 4 and report["max_error"] < 1e-6
    # The path was taken: one generation per collective, a few more for growing the slots.
    assert report["shm_ops"] == 11 * rounds + 3
    assert report["shm_ops"] <= report["generations"] <= report["shm_ops"] + 6
    assert report["identical_all_reduce"]  # bit-identical on every rank
    assert report["cap_delegated"]  # above the slot cap: gloo, shared memory untouched
    assert report["memfd_mapped"] and not report["dev_shm_mapped"]
    assert report["seen_by_mode"] == {
        "hybrid2d_shm._allgather_base_": 1,
        "hybrid2d_shm._reduce_scatter_base_": 1,
        "hybrid2d_shm.allreduce_": 1,
    }


@needs_shm
@pytest.mark.slow
def test_tp_fsdp_training_equals_gloo(tmp_path):
    """4 ranks, (1, 2, 2) mesh, TP (colwise, rowwise) x FSDP2: the losses of 3 SGD steps equal
    the same run on gloo meshes, in fp32 and bf16; DCP saves and loads through the groups."""
    check_ok(run_ranks(4, [WORKER, "train", str(tmp_path / "train.json")], timeout=240))
    report = _report(tmp_path, "train.json")
    assert report["shm_losses"] == report["gloo_losses"]
    assert report["bf16_shm_losses"] == report["bf16_gloo_losses"]
    assert all(math.isfinite(v) for v in report["shm_losses"] + report["bf16_shm_losses"])
    assert report["shm_used"] == [False, True, True, True]  # dp_replicate has one rank
    assert report["gloo_used"] == [False] * 4
    ops = report["ops"]
    assert ops["mesh_dp_shard"] >= 6 and ops["mesh_tp"] >= 3  # FSDP and TP went through it
    assert report["restored"]


@needs_shm
@pytest.mark.slow
def test_desynchronised_collective_fails_on_every_rank(tmp_path):
    out = tmp_path / "desync.json"
    results = run_ranks(2, [WORKER, "desync", str(out)], timeout=120)
    lines = {
        0: "rank 0: shared-memory collective 2 mismatch: this rank all_gather float32[1024], "
        "group rank 1 reduce_scatter float32[2048]",
        1: "rank 1: shared-memory collective 2 mismatch: this rank reduce_scatter "
        "float32[2048], group rank 0 all_gather float32[1024]",
    }
    for rank, result in enumerate(results):
        assert result.returncode != 0, result.stderr[-2000:]
        report = _report(tmp_path, f"desync.json.{rank}")
        assert report["error"] == lines[rank]
        assert report["after_s"] < 5
        assert lines[rank] in result.stderr


@needs_shm
@pytest.mark.slow
def test_late_and_dead_peers(tmp_path):
    """A peer that never arrives: a timeout naming it after the group's timeout (3 s). A peer
    that exits: an error naming it within about a second."""
    check_ok(run_ranks(3, [WORKER, "dead", str(tmp_path / "dead.json")], timeout=120))
    report = _report(tmp_path, "dead.json")
    assert report["timeout"] == (
        "rank 0: shared-memory collective 1 (all_reduce float32[4]) timed out after 3 s waiting "
        "for group ranks [2] (ranks [2])"
    )
    assert 2.9 < report["timeout_after_s"] < 5
    pid = report["pids"][2]
    assert report["dead"] == (
        f"rank 0: group rank 2 (rank 2, pid {pid}) exited during shared-memory collective 2"
    )
    assert report["dead_after_s"] < 5


@needs_shm
@pytest.mark.slow
def test_rank_killed_during_set_up_leaves_nothing(tmp_path):
    check_ok(run_ranks(1, [FORKS, "kill", str(tmp_path / "kill.json")], timeout=240))
    report = _report(tmp_path, "kill.json")
    assert len(report["runs"]) == 7
    for run in report["runs"]:
        victim = run["results"][run["victim"]]
        survivor = run["results"][1 - run["victim"]]
        assert victim["status"] in ("signal 9", "exit 9"), run
        # The survivor fails (gloo sees the closed connection, or a wait sees the dead pid)
        # instead of hanging.
        assert survivor["status"] == "exit 3" and survivor["error"], run
        assert survivor["seconds"] < 15, run
        assert not any("/dev/shm/" in link for link in run["fds"]), run
        if run["point"] not in ("pipe", "set-up:segment") or run["victim"] == 0:
            assert any(link.startswith(f"/memfd:{shm_backend.BACKEND}") for link in run["fds"])
    assert report["left_in_dev_shm"] == []


@needs_shm
@pytest.mark.slow
def test_setting_on_auto_and_hosts(tmp_path):
    check_ok(run_ranks(1, [FORKS, "policy", str(tmp_path / "policy.json")], timeout=240))
    report = _report(tmp_path, "policy.json")
    line = (
        "parallel.shm_collectives=on but shared memory is unavailable: rank 1: pretend "
        "/dev/shm is missing; use auto (falls back to the process group) or off"
    )
    for rank in report["on"]:  # every rank stops with the one line
        assert rank["config_error"] == line and rank["status"] == "exit 0", rank
    for rank in report["auto"]:  # trains over gloo
        assert rank["status"] == "exit 0", rank
        assert not rank["uses"] and rank["reason"] == "rank 1: pretend /dev/shm is missing"
        assert rank["count"] == 0 and all(math.isfinite(v) for v in rank["losses"])
    for rank in report["hosts"]:  # a group across hosts delegates, even under "on"
        assert rank["status"] == "exit 0", rank
        assert not rank["uses"] and rank["reason"] == "group spans hosts"
        assert rank["sum"] == [2.0] * 4
