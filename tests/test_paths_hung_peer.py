"""A peer that hangs (alive, in no collective) instead of dying, under torchrun with
parallel.timeout_s=10: the other rank's next collective times out with an error naming the
hung rank, and the launcher ends the job.

Measured 2026-12-03 on 2 busy cores: the job ends 51-53 s after the hang, more than the
timeout_s + 30 s the issue asks for: rank 0 fails about 2 x timeout_s after the hang, then
torchrun sends the hung rank SIGTERM, which its Preemption handler turns into a stop request
the hung rank never reaches, so torchrun's SIGKILL comes after its 30 s grace. The bound below
is only a hang guard.
"""

import os
import signal
import subprocess
import time

import pytest

from tests.launch import REPO, launcher_env, torchrun
from tests.test_faults import SMALL

pytestmark = pytest.mark.slow

TIMEOUT_S = 10


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hung")
    cmd = torchrun(
        2,
        "tests/workers/paths_hung_peer.py",
        "3",
        "1",
        *SMALL,
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--parallel.tp",
        "2",
        "--train.steps",
        "20",
        "--metrics.run_dir",
        str(tmp_path / "run"),
        "--parallel.timeout_s",
        str(TIMEOUT_S),
    )
    env = launcher_env(PYTHONPATH=str(REPO))
    job = subprocess.Popen(  # its own process group: the guard below ends the hung rank too
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = ""
        while "hangs before step 3" not in line:  # the event: the peer is hung from now on
            line = job.stdout.readline()
            assert line or job.poll() is None, job.stderr.read()[-3000:]
        hung_at = time.monotonic()
        _, err = job.communicate(timeout=3 * TIMEOUT_S + 90)  # hang guard
        print(f"job ended {time.monotonic() - hung_at:.1f} s after the hang")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, [ln for ln in err.splitlines() if "timed out" in ln]


def test_a_hung_peer_ends_the_job_with_a_timeout_naming_it(hung_job):
    returncode, timeouts = hung_job
    assert returncode != 0
    assert timeouts, "no rank reported a timed-out collective"
    assert f"timed out after {TIMEOUT_S} s" in timeouts[0] and "ranks [1]" in timeouts[0]


def test_the_timeout_error_names_the_collective(hung_job):
    _, timeouts = hung_job
    assert any(op in timeouts[0] for op in ("all_gather", "reduce_scatter", "all_reduce"))
