"""The launcher's end and start-up signals: a `kill -9` of torchrun or accelerate launch ends
every rank within seconds with one line (it left them training); SIGTERM before the first step
is a preemption with nothing to save (it was a death by signal and a traceback per rank)."""

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.launch import REPO, launcher_env, torchrun
from tests.test_config import recipe_main
from tests.test_faults import SMALL

PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphaned descendants are reparented to this process


def _descendants(pid: int) -> list[int]:
    """Every process below pid: the ranks, and any helper a launcher starts."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, todo = [], [pid]
    while todo:
        above = todo.pop()
        below = [p for p, parent in parents.items() if parent == above]
        found += below
        todo += below
    return found


def _is_rank(pid: int) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return b"\0RANK=" in b"\0" + f.read()


def _launch_cmd(launcher: str, tmp_path) -> list[str]:
    args = ["recipes/llama.py", *SMALL, "--data.cache_dir", str(tmp_path / "cache"),
            "--train.steps", "100000", "--metrics.progress_bar", "true",
            "--metrics.run_dir", str(tmp_path / "run")]  # fmt: skip
    if launcher == "torchrun":
        return torchrun(2, *args)
    return [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version",
            "2", "--num_processes", "2", "--main_process_port", "0", *args]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_kill_9_of_the_launcher_ends_every_rank_with_one_line(tmp_path, launcher):
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0  # the orphans come to us
    out, err = tmp_path / "out", tmp_path / "err"
    job, ranks = None, []
    try:
        with open(out, "w") as o, open(err, "w") as e:
            job = subprocess.Popen(
                _launch_cmd(launcher, tmp_path), cwd=REPO, env=launcher_env(), stdout=o, stderr=e
            )
        deadline = time.monotonic() + 240
        while "step 2/" not in out.read_text():  # training is under way
            assert job.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.3)
        below = _descendants(job.pid)
        ranks = [pid for pid in below if _is_rank(pid)]
        assert len(ranks) == 2, below
        job.kill()
        job.wait()
        killed_at = time.monotonic()
        status = {}  # pid -> seconds from the kill to its exit
        while len(status) < len(below) and time.monotonic() < killed_at + 20:
            for pid in below:
                if pid not in status and os.waitpid(pid, os.WNOHANG)[0] == pid:
                    status[pid] = time.monotonic() - killed_at
            time.sleep(0.1)
        for pid in set(below) - set(status):
            os.kill(pid, signal.SIGKILL)  # still running: the failure below says so
            os.waitpid(pid, 0)
    finally:
        if job is not None and job.poll() is None:  # failed before the kill: leave nothing
            below = _descendants(job.pid)
            job.kill()
            job.wait()
            for pid in below:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    text = err.read_text()
    assert len(status) == len(below), f"still running 20 s after the launcher died: {text[-2000:]}"
    lines = [ln for ln in text.splitlines() if "is gone" in ln]
    assert sorted(ln.split(":")[1] for ln in lines) == [" rank 0", " rank 1"], text[-3000:]
    assert all(ln.startswith("error: rank ") and f"pid {job.pid})" in ln for ln in lines), lines
    assert "Traceback" not in text, text[-3000:]
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*[0-9]"))  # none half-written
    print(f"{launcher}: ranks gone {max(status[pid] for pid in ranks):.1f} s after kill -9")


# Sends SIGTERM to itself once the run dir holds config.json and a TensorBoard file, the last
# moment before the first step.
STOP_AT_START_UP = textwrap.dedent(
    """
    import os, signal, sys
    import hybrid2d.trainer as t
    real = t.MetricsWriter
    def writer(*a, **k):
        made = real(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)
        return made
    t.MetricsWriter = writer
    sys.path.insert(0, "recipes")
    import llama
    sys.exit(llama.main(sys.argv[1:]))
    """
)


def test_sigterm_before_the_first_step_exits_0_with_one_line_and_leaves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "--data.cache_dir", str(tmp_path / "cache"), "--train.steps", "2",
            "--metrics.run_dir", str(run_dir)]  # fmt: skip
    env = launcher_env()

    def run(*cmd):
        return subprocess.run(
            [sys.executable, *cmd, *args], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip

    stopped = run("-c", STOP_AT_START_UP)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    lines = [ln for ln in stopped.stdout.splitlines() if "SIGTERM" in ln]
    assert lines == [
        "SIGTERM before the first step: stopped, nothing was trained or saved; relaunch the "
        "same command"
    ], stopped.stdout[-2000:]
    assert not run_dir.exists(), list(run_dir.rglob("*"))  # no earlier run for the relaunch
    again = run("recipes/llama.py")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run_dir / "summary.json").exists()


def test_main_puts_the_start_up_handlers_back_when_it_returns_without_training():
    """A test (or a tool) calling main in-process kept start-up's SIGTERM handler after a
    refused setting: a later SIGTERM would have claimed to come before a first step."""
    before = signal.getsignal(signal.SIGTERM)
    assert recipe_main(["--list"]) == 0
    assert recipe_main(["--train.steps", "0"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")
def test_sigterm_to_every_rank_while_rank_0_builds_the_data_stops_both_with_one_line(tmp_path):
    """The scheduler's SIGTERM reaches every rank while rank 1 waits in a collective for rank 0
    (which trains the tokenizer): rank 0 stops at once, and rank 1 when its wait ends."""
    run_dir = tmp_path / "run"
    cmd = torchrun(2, "recipes/llama.py", *SMALL, "--data.cache_dir", str(tmp_path / "cache"),
                   "--train.steps", "3", "--metrics.run_dir", str(run_dir))  # fmt: skip
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        job = subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=o, stderr=e)
    try:
        deadline = time.monotonic() + 240
        while "hybrid2d: recipe" not in out.read_text():  # the run dir exists; data is next
            assert job.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        ranks = [pid for pid in _descendants(job.pid) if _is_rank(pid)]
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        sent = time.monotonic()
        job.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text, said = err.read_text(), out.read_text()
    assert job.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert said.count("SIGTERM before the first step: stopped") == 1, said[-2000:]
    assert "step 1/" not in said and not run_dir.exists()
    print(f"both ranks stopped {took:.1f} s after SIGTERM")
