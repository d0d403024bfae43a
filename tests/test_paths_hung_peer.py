"""A peer that hangs (alive, in no collective) instead of dying, under torchrun with
parallel.timeout_s=10, on the shared-memory transport and on gloo: the other rank's next
collective times out, it exits 4 with one line (no traceback; on shared memory the line names
the collective and the hung rank) without waiting for that rank again, torchrun sends the
hung rank SIGTERM, and the hung rank's preemption watchdog ends it when no step boundary acts on
the signal within timeout_s. Every rank exits by itself, non-zero, within the issue's bound of
timeout_s + 30 s after the hang.

Measured 2026-12-03 on 2 cores shared with other jobs (load average 6-16), 9 runs: rank 0's
timeout 10.4-10.8 s after the hang, torchrun's SIGTERM to rank 1 1.5-3.5 s later, the job ended
21.6-25.5 s after the hang (was 51-53 s: rank 0 waited another timeout_s in the shutdown
barrier, and rank 1 lasted until torchrun's SIGKILL after its 30 s grace). The issue's bound
below leaves 15 s for a more loaded machine.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from tests.launch import REPO, launcher_env, run_ranks, torchrun
from tests.test_faults import SMALL

pytestmark = pytest.mark.slow

TIMEOUT_S = 10


def exit_codes(report: str) -> dict[int, int]:
    """{rank: exit code} from torchrun's failure report."""
    found = re.findall(
        r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", report
    )
    return {int(rank): int(code) for rank, code in found}


@pytest.fixture(scope="module", params=["on", "off"], ids=["shm", "gloo"])
def hung_job(request, tmp_path_factory):
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
        "--parallel.shm_collectives",
        request.param,
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
    out: list[str] = []
    err: list[str] = []
    hung = threading.Event()  # the event: the peer is hung from now on

    def read_stdout():
        for line in job.stdout:
            out.append(line)
            if "hangs before step 3" in line:
                hung.set()

    readers = [
        threading.Thread(target=read_stdout, daemon=True),
        threading.Thread(target=lambda: err.extend(job.stderr), daemon=True),
    ]
    for r in readers:
        r.start()
    try:
        guard = time.monotonic() + 600
        while not hung.wait(1):
            assert job.poll() is None, "".join(out + err)[-3000:]
            assert time.monotonic() < guard, "rank 1 never reached step 3"
        hung_at = time.monotonic()
        job.wait(timeout=3 * TIMEOUT_S + 90)  # hang guard
        after_hang = time.monotonic() - hung_at
        print(f"job ended {after_hang:.1f} s after the hang")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    for r in readers:
        r.join()
    return job.returncode, after_hang, "".join(err), request.param


def test_every_rank_ends_with_an_error_within_timeout_plus_30_s(hung_job):
    returncode, after_hang, err, _ = hung_job
    assert returncode != 0
    codes = exit_codes(err)
    # Each rank exited by itself (a signal's death, e.g. torchrun's SIGKILL, is < 0): rank 0
    # with the failed collective's status, rank 1 by its watchdog.
    assert codes == {0: 4, 1: 1}, (codes, err[-3000:])
    assert after_hang <= TIMEOUT_S + 30, f"ended {after_hang:.1f} s after the hang"


def test_the_timeout_is_one_line_without_a_traceback(hung_job):
    """The shared-memory transport names the collective and the hung rank; on gloo, whose
    message says only that a receive timed out, the line names the collective and its group
    (from the traceback) and the rank that posted no failure of its own in the store."""
    _, _, err, transport = hung_job
    lines = [ln for ln in err.splitlines() if ln.startswith("error: rank 0: ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].endswith(f"(parallel.timeout_s={TIMEOUT_S})")
    if transport == "on":
        assert f"timed out after {TIMEOUT_S} s" in lines[0] and "ranks [1]" in lines[0]
        assert re.search(r"\((all_gather|reduce_scatter|all_reduce) \w+\[\d+\]\)", lines[0])
    else:  # gloo's own message names neither; the line adds both, from the traceback and store
        assert f"gloo: Timed out waiting {TIMEOUT_S * 1000}ms" in lines[0]
        assert " over ranks [0, 1]; rank 1 did not come " in lines[0], lines[0]
    print(lines[0])
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, err[-3000:]


def test_the_hung_rank_says_why_it_exits(hung_job):
    _, _, err, _ = hung_job
    line = f"rank 1: got SIGTERM but step 3 did not finish within {TIMEOUT_S} s; exiting"
    assert line in err.splitlines(), err[-3000:]


@pytest.mark.parametrize("setting", ["on", "off"], ids=["shm", "gloo"])
def test_the_mesh_groups_time_out_after_timeout_s(setting):
    """The groups DeviceMesh creates took torch's 30 min default, not parallel.timeout_s: on a
    2x2 mesh a stopped rank held its tp peer (and so the job) far past timeout_s."""
    results = run_ranks(4, ["tests/workers/mesh_timeout.py", setting, "3"], timeout=120)
    out = results[3].stdout.strip().splitlines()
    assert out, results[3].stderr[-2000:]
    seconds = json.loads(out[-1])["seconds"]
    assert seconds is not None and 2.5 < seconds < 10, seconds  # rank 2 leaves at 11 s
