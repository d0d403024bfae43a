"""When things break: non-finite numbers, bad run directories, a second run, a dead rank."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed import DistBackendError

from hybrid2d import recipes, trainer
from hybrid2d.errors import ConfigError
from hybrid2d.mesh import CollectiveError, collective_failure
from tests.launch import REPO, launcher_env, torchrun

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
        cmd = torchrun(world, *cmd[1:])
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def error_lines(proc):
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


BLOW_UP = [  # SGD, an absurd learning rate, no clipping: the first update blows the weights up
    "--train.optimizer",
    "sgd",
    "--train.lr",
    "1e30",
    "--train.grad_clip",
    "0",
    "--train.warmup_steps",
    "0",
]


def model_at(run_dir, step, tmp_path) -> dict:
    """The model tensors of the run's checkpoint of `step`, read by torch's own DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"model-{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{step:07d}"), str(out))
    return torch.load(out, weights_only=False)["model"]


def test_nonfinite_loss_stops_naming_the_step_before_any_checkpoint_of_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(
        tmp_path,
        *BLOW_UP,
        "--train.steps",
        "20",
        "--checkpoint.every",
        "1",
        "--checkpoint.keep_last",
        "20",
        "--metrics.run_dir",
        str(run_dir),
    )
    assert proc.returncode == 3, proc.stderr[-3000:]  # README: exit 3 naming the step
    (line,) = error_lines(proc)
    assert "step " in line and "not finite" in line
    step = int(line.split("step ")[1].split(":")[0])
    assert 1 < step <= 20
    # summary.json says where it stopped, with the steps done before it (rank 0's line is its
    # `stopped`); the loss in the line is rounded.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert line == f"error: {summary['stopped']}" and "Traceback" not in proc.stderr
    assert summary["steps"] == step - 1 == len(summary["losses"]), summary
    loss = line.split("loss ")[1].split(",")[0]
    assert loss in ("nan", "inf", "-inf") or len(loss) <= 12, line
    # Checkpointing every step: every step before it is saved, the stopped one is not.
    ckpts = run_dir / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-"))
    assert saved == [f"step-{s:07d}" for s in range(1, step)], saved
    assert (ckpts / "latest").read_text().strip() == f"step-{step - 1:07d}"


def test_nonfinite_skip_leaves_every_parameter_bit_identical(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(
        tmp_path,
        *BLOW_UP,
        "--train.steps",
        "5",
        "--train.on_nonfinite",
        "skip",
        "--checkpoint.every",
        "1",
        "--checkpoint.keep_last",
        "5",
        "--metrics.run_dir",
        str(run_dir),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [
        int(ln.split()[1].rstrip(":"))
        for ln in proc.stdout.splitlines()
        if ln.endswith("update skipped")
    ]
    assert skipped and skipped == list(range(skipped[0], 6)), proc.stdout  # once NaN, always
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 5
    # The count is in summary.json and in the closing lines (exit 0 still: README says why).
    assert summary["skipped_steps"] == skipped
    steps = str(skipped[0]) if skipped[0] == 5 else f"{skipped[0]}-5"
    line = f"  skipped        {len(skipped)} of 5 updates (non-finite): steps {steps}"
    assert line in proc.stdout.splitlines(), proc.stdout
    # Steps 1.. before the first skip changed the weights; every skipped step left each tensor
    # bit for bit as the step before it had it.
    first = skipped[0]
    before = model_at(run_dir, first - 1, tmp_path)
    for step in skipped:
        after = model_at(run_dir, step, tmp_path)
        assert set(after) == set(before)
        for name, t in before.items():
            assert torch.equal(after[name], t), f"step {step} changed {name}"


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
    proc = train(  # timeout: the hang guard (rank 1 must not wait for rank 0 forever)
        tmp_path,
        "--train.steps",
        "1",
        "--metrics.run_dir",
        str(blocker / "run"),
        world=2,
        timeout=120,
    )
    # torchrun exits 1 when a rank fails; the ranks' own exit code is the documented 2.
    assert proc.returncode != 0
    assert "exitcode  : 2 " in proc.stderr, proc.stderr[-3000:]
    assert "not writable" in proc.stderr


def test_nodes_launched_with_other_settings_fail_with_one_line(tmp_path):
    """Ranks 2-3 (a second node) launched with --parallel.tp 1, ranks 0-1 with tp 2: one line
    naming the setting on every rank, before any group is built. It was: the tp 1 ranks timed
    out on a gloo recv after parallel.timeout_s, the tp 2 ranks hung without a word."""
    cmd = torchrun(
        4, "tests/workers/rank_args.py", "2", "--parallel.tp 1", *SMALL,
        "--data.cache_dir", str(tmp_path / "cache"), "--metrics.run_dir", str(tmp_path / "run"),
        "--train.steps", "2", "--parallel.tp", "2", "--parallel.timeout_s", "60",
    )  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 60, "waited for a collective to time out"
    assert error_lines(proc) == [
        "error: rank 2 was launched with other settings than rank 0: parallel.tp=1 (rank 0: 2); "
        "launch every node with the same command line and config"
    ], proc.stderr[-3000:]
    # torchrun adds its own ChildFailedError report (with a traceback of torchrun's frames).
    assert "exitcode  : 2 " in proc.stderr and "hybrid2d/" not in proc.stderr, proc.stderr


HOLD_LOCK = """
import sys
from hybrid2d.run_dir import acquire_lock
acquire_lock(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes stdin
"""


def test_second_run_in_same_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(  # a run holding the directory, as a run does: acquire_lock
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)],
        cwd=REPO,
        env=launcher_env(PYTHONPATH=str(REPO)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = train(tmp_path, "--train.steps", "1", "--metrics.run_dir", str(run_dir))
        assert proc.returncode == 2
        (line,) = error_lines(proc)
        assert "in use" in line and f"pid {holder.pid} " in line
    finally:
        holder.kill()  # dies without releasing: its lock file stays behind
        holder.wait()
    assert (run_dir / ".lock").exists()
    # README: a lock left by a dead process is taken over.
    proc = train(tmp_path, "--train.steps", "2", "--metrics.run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run_dir / ".lock").exists()  # released at the end


@pytest.mark.slow
def test_killed_rank_ends_job_quickly_naming_it(tmp_path):
    """kill -9 one rank mid-training: the launcher exits non-zero, naming the rank, in < 60 s."""
    env = launcher_env()
    run_dir = tmp_path / "run"
    cmd = torchrun(
        4,
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
    )
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


@pytest.mark.parametrize(
    "error, raised, waits",
    [
        (DistBackendError("rank 0: collective 61 timed out"), CollectiveError, False),  # alone
        (RuntimeError("a bug of this rank's own"), RuntimeError, False),
        (ConfigError("raised on every rank by mesh.agree"), ConfigError, True),
        (FloatingPointError("step 3: loss nan"), FloatingPointError, True),  # all ranks
    ],
)
def test_a_rank_that_failed_alone_does_not_wait_for_its_peers_at_shutdown(
    monkeypatch, error, raised, waits
):
    """The shutdown barrier after a timed-out collective waited another parallel.timeout_s for
    the hung peer (the job ended 2 x timeout_s after the hang); errors every rank raises
    together keep it (it keeps a peer's gloo teardown from aborting this rank). A failed
    collective becomes a CollectiveError (one line, exit 4); any other error stays itself."""
    calls = []
    for name in ("init_distributed", "build_mesh", "planned", "set_cpu_threads"):
        monkeypatch.setattr(trainer, name, lambda *a, **k: {})

    def fail(*args):
        raise error

    monkeypatch.setattr(trainer, "_train", fail)
    monkeypatch.setattr(
        trainer, "shutdown_distributed", lambda wait_for_peers=True: calls.append(wait_for_peers)
    )
    with pytest.raises(raised) as caught:
        trainer.run(recipes.get("llama-debug"))
    assert type(caught.value) is raised
    assert calls == [waits]


GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 10000ms for recv operation to complete"
)
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:14760: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application. Check the logs of the remote worker before reporting "
    "an error. GLHF! \U0001f3d6\ufe0f"
)


@pytest.mark.parametrize(
    "error, reason",
    [
        (
            RuntimeError(GLOO_TIMEOUT),
            "gloo: Timed out waiting 10000ms for recv operation to complete",
        ),
        (
            RuntimeError(GLOO_PEER_GONE),
            "gloo: Read error [127.0.0.1]:14760: Connection reset by peer",
        ),
        (DistBackendError("rank 1: group rank 0 exited\ndetails"), "rank 1: group rank 0 exited"),
        (RuntimeError("shape mismatch in gloo/foo"), None),  # a bug, not the transport
        (RuntimeError("Expected all tensors to be on the same device"), None),
        (KeyError("gloo"), None),
    ],
)
def test_a_failed_collective_is_told_from_a_bug(error, reason):
    """gloo's messages (captured from torch 2.13's gloo: a hung and a killed peer), nccl and
    the shared-memory backend (DistBackendError) are the transport's; anything else keeps its
    traceback."""
    assert collective_failure(error) == reason


GLOO_TIMEOUT = """
import sys, time, torch, torch.distributed as dist
from hybrid2d.mesh import as_collective_error, group_options, init_distributed
init_distributed("cpu", 3, "off")
backend, options = group_options(3)
group = dist.new_group([0, 1, 2], backend=backend, pg_options=options)
if dist.get_rank() == 2:
    time.sleep(12)  # hung: never comes to the all-reduce
else:
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as e:
        print(as_collective_error(e, 3))
"""


@pytest.mark.slow
def test_a_gloo_timeout_names_the_collective_its_group_and_the_rank_that_did_not_come():
    """gloo's own message names none of them ('Timed out waiting 3000ms for recv operation'):
    the line adds the collective and the group's ranks, read from the traceback, and the rank
    that posted no failure of its own in the store."""
    from tests.launch import run_ranks

    *came, hung = run_ranks(3, ["-c", GLOO_TIMEOUT], timeout=120)
    for rank, proc in enumerate(came):
        line = proc.stdout.strip()
        assert line.startswith(f"rank {rank}: gloo: "), proc.stderr[-2000:] + hung.stderr[-2000:]
        assert line.endswith(
            " in all_reduce over ranks [0, 1, 2]; rank 2 did not come (no failure of its own "
            "within 3 s) (parallel.timeout_s=3)"
        ), line
