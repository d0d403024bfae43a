"""--profile.trace_steps: the setting's checks, the reading of a chrome trace (synthetic traces
whose parts are known), and what a run wrote (`check_run_traces`, called by the 2-rank launch of
tests/test_memory.py, which also profiles memory)."""

import json

import pytest
import torch

from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.profiling.traces import PARTS, STEP_MARK, StepTraces, breakdown, format_table


@pytest.mark.parametrize("value", ["0-2", "4-3", "3", "a-b", "3-4-5", "-1-2", "2-"])
def test_trace_steps_not_a_range_is_one_line_naming_the_setting(value):
    cfg = JobConfig()
    cfg.profile.trace_steps = value
    with pytest.raises(ConfigError) as e:
        cfg.check_settings()
    assert str(e.value).startswith(f"profile.trace_steps={value!r} is not a step range A-B")
    assert "\n" not in str(e.value)


def test_trace_steps_range_and_its_end():
    cfg = JobConfig()
    cfg.train.steps = 10
    for value, expected in (("", None), ("3-4", (3, 4)), (" 5 - 5 ", (5, 5)), ("1-10", (1, 10))):
        cfg.profile.trace_steps = value
        cfg.check_settings()
        assert cfg.profile.trace_range() == expected
    cfg.profile.trace_steps = "9-11"
    with pytest.raises(ConfigError, match=r"ends after the last step \(train.steps=10\)"):
        cfg.check_settings()


def _x(name, ts, dur, cat="cpu_op", tid=1, pid=7):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_cpu_trace_parts_by_hand():
    """Step 1 is [0, 100) us, step 2 [200, 300) on thread 1. Thread 1: an op [0, 40), a
    backward [40, 90) with a c10d collective [50, 80) nested in it; step 2: an op [200, 260)
    and a wait [270, 290). gloo's worker (thread 2) runs [20, 60) and [250, 280). An op outside
    the steps [120, 180) and a project's autograd Function named after a collective [200, 210)
    (compute: only c10d's namespaces count as communication)."""
    events = [
        _x(f"{STEP_MARK}1", 0, 100, "user_annotation"),
        _x(f"{STEP_MARK}2", 200, 100, "user_annotation"),
        _x("aten::mm", 0, 40),
        _x("autograd::engine::evaluate_function: XBackward", 40, 50),
        _x("c10d::allreduce_", 50, 30),
        _x("aten::mm", 120, 60),
        _x("_ReduceScatterSequence", 200, 10),
        _x("aten::add", 200, 60),
        _x("_c10d_functional::wait_tensor", 270, 20),
        _x("gloo:all_gather", 20, 40, "user_annotation", tid=2),
        _x("aten::copy_", 25, 5, tid=2),  # inside gloo's work: not this rank's compute lane
        _x("gloo:all_reduce", 250, 30, "user_annotation", tid=2),
    ]
    b = breakdown({"traceEvents": events})
    # compute: [0,50) [80,90) [200,260) = 120; comm: [20,80) [250,290) = 100;
    # overlap: [20,50) [250,260) = 40; busy 180 of wall 200: idle 20.
    assert b["steps"] == [1, 2]
    got = [b[k] * 1e6 for k in PARTS]
    assert got == pytest.approx([200, 120, 100, 40, 20])
    assert b["lanes"] == "the step's CPU thread"
    assert list(b["collectives"]) == [
        "gloo:all_gather",
        "c10d::allreduce_",
        "gloo:all_reduce",
        "_c10d_functional::wait_tensor",
    ]


def test_device_trace_uses_kernels_and_nccl_streams():
    """With kernels in the trace the lanes are the device's streams: host ops do not count."""
    events = [
        _x(f"{STEP_MARK}4", 0, 100, "user_annotation"),
        _x("aten::mm", 0, 100),  # the host launching: not compute on a device trace
        _x("c10d::_allgather_base_", 0, 5),  # nor communication: it queues the nccl kernel
        _x("sm80_xmma_gemm", 10, 50, "kernel", tid=7, pid=0),
        _x("ncclDevKernel_AllGather_RING_LL", 40, 40, "kernel", tid=13, pid=0),
        _x("elementwise_kernel", 70, 20, "kernel", tid=7, pid=0),
    ]
    b = breakdown({"traceEvents": events})
    # compute [10,60) [70,90) = 70; comm [40,80) = 40; overlap [40,60) [70,80) = 30; idle 20
    assert [b[k] * 1e6 for k in PARTS] == pytest.approx([100, 70, 40, 30, 20])
    assert b["lanes"] == "device streams" and b["steps"] == [4]


def test_a_trace_without_steps_is_empty_not_an_error():
    b = breakdown({"traceEvents": [_x("aten::mm", 0, 5)]})
    assert b["steps"] == [] and b["wall_s"] == 0.0


def test_table_of_many_ranks_names_the_outliers_and_aggregates():
    rows = [
        {"rank": r, "wall_s": 1.0, "compute_s": 0.9 - (0.5 if r == 77 else 0.0), "comm_s": 0.1,
         "overlap_s": 0.0, "idle_s": 0.0 + (0.5 if r == 77 else 0.0), "lanes": "device streams",
         "collectives": {"nccl:all_gather": 0.1}}
        for r in range(256)
    ]  # fmt: skip
    text = format_table(rows, (3, 4), "RUN/traces")
    lines = text.splitlines()
    assert len(lines) < 20  # readable: not one line per rank
    assert lines[2].split()[0] == "min" and lines[4].split()[0] == "max"
    assert any(ln.split()[0] == "77" for ln in lines)  # the rank that computes least
    small = format_table(rows[:2], (3, 4), "RUN/traces").splitlines()
    assert [ln.split()[0] for ln in small[2:4]] == ["0", "1"]


def check_run_traces(run_dir, steps: tuple[int, int], world: int, stdout: str) -> None:
    """What a run with --profile.trace_steps A-B wrote: a trace per rank holding exactly the
    steps A..B (read from the file itself), and a breakdown whose parts add up to the wall time
    of those steps, with communication on a run that has collectives."""
    a, b = steps
    summary = json.loads((run_dir / "traces" / "breakdown.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == list(range(world))
    for r in summary["ranks"]:
        trace = json.loads((run_dir / "traces" / f"rank{r['rank']}.pt.trace.json").read_text())
        marks = [
            e for e in trace["traceEvents"]
            if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_MARK)
        ]  # fmt: skip
        assert sorted(int(e["name"][len(STEP_MARK) :]) for e in marks) == list(range(a, b + 1))
        assert r["wall_s"] == pytest.approx(sum(e["dur"] for e in marks) / 1e6, rel=1e-6)
        parts = r["compute_s"] + r["comm_s"] - r["overlap_s"] + r["idle_s"]
        assert parts == pytest.approx(r["wall_s"], rel=1e-6)
        assert r["compute_s"] > 0 and r["comm_s"] > 0 and r["idle_s"] >= 0
        assert 0 <= r["overlap_s"] <= min(r["compute_s"], r["comm_s"])
        assert any(
            n.startswith(("c10d::", "_c10d_functional::", "gloo:")) for n in r["collectives"]
        )
    assert f"traces of steps {a}-{b}" in stdout


def test_one_process_traces_only_the_range_and_reports_it(tmp_path, capsys):
    """Without a process group: steps 1-4 run, 2-3 are traced, the table is printed and
    breakdown.json written; torch ops inside the steps are compute, and nothing communicates."""
    traces = StepTraces((2, 3), str(tmp_path))
    x = torch.randn(64, 64)
    for step in range(1, 5):
        with traces.step(step):
            for _ in range(20):
                x = torch.tanh(x @ x)
    rows = traces.report()
    trace = json.loads((tmp_path / "traces" / "rank0.pt.trace.json").read_text())
    assert breakdown(trace)["steps"] == [2, 3] and [r["rank"] for r in rows] == [0]
    r = rows[0]
    assert r["compute_s"] > 0 and r["comm_s"] == 0 and r["overlap_s"] == 0
    assert r["compute_s"] + r["idle_s"] == pytest.approx(r["wall_s"], rel=1e-6)
    saved = json.loads((tmp_path / "traces" / "breakdown.json").read_text())
    assert saved == {"steps": [2, 3], "ranks": rows}
    assert "traces of steps 2-3" in capsys.readouterr().out


def test_a_launch_that_ran_no_step_of_the_range_says_so(tmp_path, capsys):
    """A resume that starts past B traces nothing: one line, no breakdown.json, no error."""
    traces = StepTraces((2, 3), str(tmp_path))
    for step in (7, 8):
        with traces.step(step):
            pass
    assert traces.report() == []
    assert "none recorded (no step of the range ran in this launch)" in capsys.readouterr().out
    assert not (tmp_path / "traces").exists()
