"""Checkpoint writes that fail: never lost, never published.

- A write that raises (a full disk) on one rank, async or sync, ends every rank with exit 2
  and one line naming the failing rank, the step, the path and the error (no traceback): a
  sync save at once, an async one at the next save or when the run closes. The step is not
  published, its directory is removed, and no summary claims the run finished.
- A rank killed inside its background write of step 10 ends the job; `resume auto` goes on
  from step 5, the last published checkpoint, and ends with the uninterrupted run's losses.
"""

import pytest

from hybrid2d.checkpoint import layout
from tests.test_checkpoint_runs import args_for, assert_close, steps_in, summary, train

pytestmark = pytest.mark.slow

WORKER = "tests/workers/paths_failing_writer.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("async-cache"))


def async_args(cache, run, steps):
    return args_for(cache, run, dp=1, tp=2, every=5, async_save="true", train__steps=steps)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_failing_write_is_one_line_and_exit_2_on_every_rank(cache, tmp_path, mode):
    run = tmp_path / "run"
    # async: steps 6-8 train while step 5 is being written; the failure surfaces at the end.
    args = async_args(cache, run, 8)
    if mode == "sync":
        args[args.index("--checkpoint.async_save") + 1] = "false"
    results = train(2, args, f"{WORKER} raise 5 1", ok=False)
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-3000:] for r in results]
    for r in results:
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
    # The entry point prints errors on rank 0 only: one line for the whole job.
    lines = [ln for r in results for ln in r.stderr.splitlines() if "checkpoint save" in ln]
    tmp = layout.tmp_dir(run, 5)
    assert lines == [
        f"error: rank 1: {mode} checkpoint save of step 5 failed: OSError: [Errno 28] injected "
        f"write failure of step 5 (writing {tmp}; nothing was published)"
    ], [r.stderr[-3000:] for r in results]
    assert steps_in(run) == [] and not layout.final_dir(run, 5).exists() and not tmp.exists()
    assert not (run / "checkpoints" / layout.LATEST).exists()
    assert not (run / "summary.json").exists()


def test_a_rank_killed_in_its_async_write_resumes_from_the_previous_checkpoint(cache, tmp_path):
    straight = tmp_path / "straight"
    train(2, async_args(cache, straight, 15))
    run = tmp_path / "run"
    args = async_args(cache, run, 15) + ["--parallel.timeout_s", "30"]
    results = train(2, args, f"{WORKER} kill 10 1", ok=False)
    assert results[1].returncode == -9 and results[0].returncode != 0
    assert steps_in(run) == [5]
    train(2, async_args(cache, run, 15) + ["--checkpoint.resume", "auto"])
    r = summary(run)
    assert r["resumed_from"] == str(layout.final_dir(run, 5)) and r["steps"] == 15
    assert_close(r["losses"], summary(straight)["losses"][5:], rtol=0)
    assert steps_in(run) == [5, 10, 15]
