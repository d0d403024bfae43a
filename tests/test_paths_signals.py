"""SIGUSR1 in a real 2-rank run: sent to one rank only, every rank saves a checkpoint at the
same step and the job exits 0; the next launch resumes from it. The same while an async save
is still being written: that save is finished and published, then the current step is saved."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.launch import REPO, launcher_env, torchrun
from tests.test_faults import SMALL, _rank_pid

pytestmark = pytest.mark.slow

STEPS = 100000  # never reached: the signal ends the run


def launch(tmp_path, run_dir, steps=STEPS):
    cmd = torchrun(
        2,
        "recipes/llama.py",
        *SMALL,
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--parallel.tp",
        "2",
        "--train.steps",
        str(steps),
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
        cmd, cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A 2-rank run whose rank 1 alone gets SIGUSR1 once step 5 is saved."""
    tmp_path = tmp_path_factory.mktemp("sigusr1")
    run_dir = tmp_path / "run"
    job = launch(tmp_path, run_dir)
    try:
        latest = run_dir / "checkpoints" / "latest"
        hang_guard = time.monotonic() + 600
        while not latest.exists():  # the event: step 5 is saved, training is under way
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < hang_guard, "no checkpoint of step 5"
            time.sleep(0.2)
        os.kill(_rank_pid(job.pid, rank=1), signal.SIGUSR1)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err[-4000:]
    return tmp_path, run_dir, out, json.loads((run_dir / "summary.json").read_text())


def test_sigusr1_to_one_rank_saves_the_current_step_and_exits_0(stopped_run):
    tmp_path, run_dir, out, summary = stopped_run
    stopped = summary["steps"]
    assert 5 <= stopped < STEPS, summary
    latest = run_dir / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step-{stopped:07d}"
    assert f"a signal on another rank: saved a checkpoint at step {stopped}" in out

    job = launch(tmp_path, run_dir, steps=stopped + 2)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-4000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from"].endswith(f"step-{stopped:07d}")
    assert resumed["steps"] == stopped + 2 and len(resumed["losses"]) == 2


def test_summary_says_preempted_when_another_rank_got_the_signal(stopped_run):
    assert stopped_run[3]["preempted"]


def test_sigusr1_during_an_async_save_finishes_it_saves_the_current_step_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    cmd = torchrun(
        2,
        "tests/workers/paths_held_writer.py",
        "50",
        *SMALL,
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--parallel.tp",
        "2",
        "--train.steps",
        str(STEPS),
        "--checkpoint.every",
        "50",
        "--checkpoint.async_save",
        "true",
        "--metrics.run_dir",
        str(run_dir),
        "--parallel.timeout_s",
        "30",
    )
    env = launcher_env(PYTHONPATH=str(REPO))
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = ""
        while "holding the write of step 50" not in line:  # the event: the save is in flight
            line = job.stdout.readline()
            assert line or job.poll() is None, job.stderr.read()[-3000:]
        os.kill(_rank_pid(job.pid, rank=1), signal.SIGUSR1)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err[-4000:]
    assert "released without a stop request" not in out  # the signal came during the write
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert 50 <= stopped < 90, summary
    assert [c["step"] for c in summary["checkpoints"]] == sorted({50, stopped})
    latest = run_dir / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step-{stopped:07d}"
    assert (run_dir / "checkpoints" / "step-0000050").is_dir()
    assert f"saved a checkpoint at step {stopped}" in out


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_saves_the_step_and_twice_stops_at_once(tmp_path, presses):
    """One process: one Ctrl-C says at once that the run stops after this step, saves it and
    exits 0 (as SIGTERM does); a second one stops at once with one error line and exit 130.
    Ctrl-C used to end in a KeyboardInterrupt traceback and no checkpoint."""
    import sys

    run_dir = tmp_path / "run"
    # The step lines on stdout tell when training runs; 2,000 steps: ends even if no signal
    # arrives, so a broken test fails instead of hanging.
    cmd = [sys.executable, "recipes/llama.py", *SMALL, "--metrics.progress_bar", "true",
           "--data.cache_dir", str(tmp_path / "c"), "--train.steps", "2000",
           "--metrics.run_dir", str(run_dir)]  # fmt: skip
    job = subprocess.Popen(
        cmd, cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        seen = ""
        while "step 3/" not in seen:  # training is under way (stdout: the step lines)
            line = job.stdout.readline()
            assert line, job.communicate()[1][-3000:]
            seen += line
        job.send_signal(signal.SIGINT)
        said = ""
        while "Ctrl-C" not in said:  # the line the first Ctrl-C prints at once
            line = job.stderr.readline()
            assert line, said + job.communicate()[1][-3000:]
            said += line
        if presses == 2:  # the first was handled: this one is not merged into it
            job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=300)
        err = said + err
    finally:
        if job.poll() is None:
            job.kill()
    assert "Ctrl-C: stopping after this step with a checkpoint" in err
    assert "Traceback" not in err, err[-3000:]
    if presses == 1:
        assert job.returncode == 0, err[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["preempted"] and summary["steps"] >= 3, summary
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step-{summary['steps']:07d}"
        assert f"SIGINT: saved a checkpoint at step {summary['steps']}" in out
    else:
        assert job.returncode == 130, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "interrupted (Ctrl-C)" in errors[0], err[-3000:]
