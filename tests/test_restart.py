"""A rank dies; the launcher restarts the job; it resumes from the latest checkpoint and ends
exactly where an uninterrupted run ends."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.launch import REPO, launcher_env, torchrun
from tests.test_faults import SMALL, _rank_pid

pytestmark = pytest.mark.slow

STEPS = 20


def launch(tmp_path, run_dir, restarts: int) -> subprocess.Popen:
    env = launcher_env()
    # --standalone: c10d rendezvous (each restart attempt is a new round) on ports the agent
    # binds itself.
    cmd = torchrun(
        2,
        "--max_restarts",
        str(restarts),
        "recipes/llama.py",
        *SMALL,
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--parallel.tp",
        "2",
        "--train.steps",
        str(STEPS),
        "--checkpoint.every",
        "5",
        "--checkpoint.resume",
        "auto",
        "--metrics.run_dir",
        str(run_dir),
        "--parallel.timeout_s",
        "30",
    )
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_restart_resumes_and_matches_uninterrupted(tmp_path):
    straight = launch(tmp_path, tmp_path / "straight", restarts=0)
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-3000:]
    expected = json.loads((tmp_path / "straight" / "summary.json").read_text())

    run_dir = tmp_path / "restarted"
    job = launch(tmp_path, run_dir, restarts=1)
    try:
        deadline = time.monotonic() + 300
        latest = run_dir / "checkpoints" / "latest"
        while not (latest.exists() and latest.read_text().strip() >= "step-0000010"):
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.kill(_rank_pid(job.pid, rank=1), signal.SIGKILL)
        _, err = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    got = json.loads((run_dir / "summary.json").read_text())
    assert got["resumed_from"] is not None and got["steps"] == STEPS
    assert got["last_loss"] == pytest.approx(expected["last_loss"], rel=1e-6)
    assert got["losses"] == pytest.approx(expected["losses"][-len(got["losses"]) :], rel=1e-6)


def test_sigterm_saves_current_step_and_next_launch_resumes(tmp_path):
    """Preemption: SIGTERM to every rank (as SLURM does) -> checkpoint at that step, exit 0."""
    run_dir = tmp_path / "preempted"
    job = launch(tmp_path, run_dir, restarts=0)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "latest").exists():  # past step 5
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for rank in (0, 1):
            os.kill(_rank_pid(job.pid, rank=rank), signal.SIGTERM)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["preempted"] and 5 <= stopped < STEPS, summary
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:07d}"
    assert f"saved a checkpoint at step {stopped}" in out

    job = launch(tmp_path, run_dir, restarts=0)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-4000:]
    assert "settings changed" not in out  # the same command line: nothing to report
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from"].endswith(f"step-{stopped:07d}")
    assert resumed["steps"] == STEPS and len(resumed["losses"]) == STEPS - stopped
    assert resumed["first_step"] == stopped + 1 and summary["first_step"] == 1
