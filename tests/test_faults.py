"""When things break: non-finite numbers, bad run directories, a second run, a dead rank."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import REPO, free_port, launcher_env

SMALL = [
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.ffn_dim",
    "128",
    "--model.vocab_size",
    "512",
    "--train.seq_len",
    "32",
    "--data.max_chars",
    "100000",
    "--metrics.progress_bar",
    "false",
]


def train(tmp_path, *args, world=1, timeout=300):
    env = launcher_env()
    cmd = [
        sys.executable,
        "recipes/llama.py",
        *SMALL,
        "--data.cache_dir",
        str(tmp_path / "cache"),
        *args,
    ]
    if world > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world),
            "--master_port",
            str(free_port()),
            *cmd[1:],
        ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def error_lines(proc):
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def test_nonfinite_loss_stops_naming_the_step(tmp_path):
    run_dir = tmp_path / "run"
    # SGD with an absurd learning rate and no clipping: the first update blows the weights up.
    proc = train(
        tmp_path,
        "--train.optimizer",
        "sgd",
        "--train.lr",
        "1e30",
        "--train.grad_clip",
        "0",
        "--train.warmup_steps",
        "0",
        "--train.steps",
        "20",
        "--metrics.run_dir",
        str(run_dir),
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert "step " in line and "not finite" in line
    step = int(line.split("step ")[1].split(":")[0])
    assert 1 < step <= 20
    assert not (run_dir / "summary.json").exists()


def test_nonfinite_skip_keeps_training_without_updates(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(
        tmp_path,
        "--train.optimizer",
        "sgd",
        "--train.lr",
        "1e30",
        "--train.grad_clip",
        "0",
        "--train.warmup_steps",
        "0",
        "--train.steps",
        "6",
        "--train.on_nonfinite",
        "skip",
        "--metrics.run_dir",
        str(run_dir),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update skipped" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6


def test_unwritable_run_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = train(tmp_path, "--train.steps", "1", "--metrics.run_dir", str(blocker / "run"))
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "metrics.run_dir" in line and "not writable" in line


@pytest.mark.slow
def test_unwritable_run_dir_two_ranks_no_hang(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    start = time.monotonic()
    proc = train(
        tmp_path,
        "--train.steps",
        "1",
        "--metrics.run_dir",
        str(blocker / "run"),
        world=2,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "not writable" in proc.stderr
    assert time.monotonic() - start < 60


def test_second_run_in_same_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (run_dir / ".lock").write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid})
        )
        proc = train(tmp_path, "--train.steps", "1", "--metrics.run_dir", str(run_dir))
        assert proc.returncode == 2
        (line,) = error_lines(proc)
        assert "in use" in line and str(holder.pid) in line
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: its lock is stale and the next run takes it over.
    proc = train(tmp_path, "--train.steps", "2", "--metrics.run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run_dir / ".lock").exists()  # released at the end


@pytest.mark.slow
def test_killed_rank_ends_job_quickly_naming_it(tmp_path):
    """kill -9 one rank mid-training: the launcher exits non-zero, naming the rank, in < 60 s."""
    env = launcher_env()
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "4",
        "--master_port",
        str(free_port()),
        "recipes/llama.py",
        *SMALL,
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--parallel.tp",
        "2",
        "--train.steps",
        "100000",
        "--metrics.run_dir",
        str(run_dir),
        "--parallel.timeout_s",
        "30",
    ]
    launcher = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "tensorboard").exists():  # training has started
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(3)
        victim = _rank_pid(launcher.pid, rank=2)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert took < 60, took
    assert "rank      : 2" in err or "rank 2" in err, err[-3000:]
    print(f"failure surfaced after {took:.1f} s")


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the child of the launcher whose environment says RANK=rank."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if env.get(b"RANK") == str(rank).encode():
                return int(pid)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no rank {rank} under launcher {launcher_pid}")
