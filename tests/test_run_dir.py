"""The run dir (hybrid2d/run_dir.py): a flock that dies with its process, and no launch that
writes over an earlier run.

Every wait here is for an event (a line from a child, a child's exit), never for a time.
"""

import os
import signal
import subprocess
import sys

import pytest

from hybrid2d import run_dir
from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from tests.launch import REPO

HOLD = """
import sys
from hybrid2d.run_dir import acquire_lock
acquire_lock(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # hold until the test closes stdin (or kills us)
"""

RACE = """
import sys
from hybrid2d.errors import ConfigError
from hybrid2d.run_dir import acquire_lock
print("ready", flush=True)
sys.stdin.readline()  # all starters go at once
try:
    acquire_lock(sys.argv[1])
    print("ok", flush=True)
except ConfigError as e:
    print("refused", e, flush=True)
sys.stdin.read()  # keep what we got until the test has every answer
"""

CHURN = """
import os, sys
from hybrid2d.errors import ConfigError
from hybrid2d.run_dir import acquire_lock, release_locks
inside = os.path.join(sys.argv[1], "inside")
got = 0
for _ in range(int(sys.argv[2])):
    try:
        acquire_lock(sys.argv[1])
    except ConfigError:
        continue
    got += 1
    fd = os.open(inside, os.O_CREAT | os.O_EXCL)  # FileExistsError: two holders at once
    os.close(fd)
    os.unlink(inside)
    release_locks()
print("acquired", got, flush=True)
"""


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def release():
    yield
    run_dir.release_locks()


def test_lock_dies_with_its_process(tmp_path, release):
    holder = _start(HOLD, str(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        with pytest.raises(ConfigError) as e:
            run_dir.acquire_lock(str(tmp_path))
        msg = str(e.value)
        assert f"pid {holder.pid} " in msg and "in use" in msg and "\n" not in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The holder is gone (reaped), its lock with it: the next acquire succeeds at once.
    run_dir.acquire_lock(str(tmp_path))
    run_dir.release_locks()
    assert not (tmp_path / run_dir.LOCK_NAME).exists()


def test_same_process_cannot_take_its_own_run_dir_twice(tmp_path, release):
    run_dir.acquire_lock(str(tmp_path))
    with pytest.raises(ConfigError, match=f"pid {os.getpid()} "):
        run_dir.acquire_lock(str(tmp_path))


def test_two_starters_never_both_take_over_a_stale_lock(tmp_path):
    holder = _start(HOLD, str(tmp_path))
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / run_dir.LOCK_NAME).exists()  # stale: its file names a dead pid
    starters = [_start(RACE, str(tmp_path)) for _ in range(4)]
    try:
        for s in starters:
            assert s.stdout.readline().strip() == "ready", s.stderr.read()
        for s in starters:
            s.stdin.write("go\n")
            s.stdin.flush()
        answers = [s.stdout.readline().strip() for s in starters]
    finally:
        for s in starters:
            s.kill()
            s.wait()
    winners = [a for a in answers if a == "ok"]
    assert len(winners) == 1, answers
    winner = starters[answers.index("ok")].pid
    for a in answers:  # the owner named is the winner (or, had it not written yet, nobody)
        assert a == "ok" or f"pid {winner} " in a or "another process" in a, answers


def test_release_and_acquire_churn_never_admits_two(tmp_path):
    """Two processes lock, enter, leave and release (unlinking the file) as fast as they can."""
    procs = [_start(CHURN, str(tmp_path), "300") for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.startswith("acquired ")
    assert sum(int(out.split()[1]) for out, _ in outs) > 0


def _settings(path, resume: str = "") -> JobConfig:
    cfg = JobConfig()
    cfg.metrics.run_dir = str(path)
    cfg.checkpoint.resume = resume
    return cfg


@pytest.mark.parametrize("left", ["config.json", "summary.json", "tensorboard"])
def test_a_run_dir_an_earlier_launch_trained_in_is_refused_without_checkpoints(
    tmp_path, release, left
):
    """It was reused silently: config.json and summary.json overwritten, a second TensorBoard
    file over the same steps. Now one line naming the dir, what it holds and the ways out;
    the earlier run's files stay as they were."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # its checkpoints deleted (or none saved)
    if left == "tensorboard":
        (run / left).mkdir()
    else:
        (run / left).write_text("{}")
    with pytest.raises(ConfigError) as e:
        run_dir.create_run_dir(_settings(run))
    msg = str(e.value)
    assert msg.startswith(f"metrics.run_dir={run} holds an earlier run ({left})"), msg
    assert "another --metrics.run_dir" in msg and "delete" in msg and "\n" not in msg
    run_dir.release_locks()
    assert sorted(p.name for p in run.iterdir()) == sorted(["checkpoints", left])


def test_a_run_dir_is_taken_when_new_empty_resumed_or_holding_checkpoints(tmp_path, release):
    """A new or empty dir (a refused launch leaves only its lock, and removes that), and with
    --checkpoint.resume an earlier run's dir, are taken; one with checkpoints is left to
    find_resume, whose line names them."""
    for path in (tmp_path / "new", tmp_path):
        assert run_dir.create_run_dir(_settings(path)) == str(path)
        run_dir.release_locks()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    for resume in ("auto", str(tmp_path / "elsewhere")):
        assert run_dir.create_run_dir(_settings(earlier, resume)) == str(earlier)
        run_dir.release_locks()
    (earlier / "checkpoints" / "step-0000002").mkdir(parents=True)
    assert run_dir.create_run_dir(_settings(earlier)) == str(earlier)
