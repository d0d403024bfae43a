"""hybrid2d.metrics.progress and .summary: what rank 0 prints and logs per step, and the summary's
closing lines, for given step results (one gloo rank, no training)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hybrid2d.layout import RunLayout
from hybrid2d.metrics.progress import RunProgress
from hybrid2d.metrics.summary import against_plan, format_summary
from hybrid2d.planner.launch import describe_plan
from hybrid2d.trainer import StepResult
from tests.reference import tiny_config


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Scalars:
    """A MetricsWriter that keeps what it was given."""

    def __init__(self):
        self.logged: dict[int, list[str]] = {}

    def scalars(self, step, values):
        self.logged.setdefault(step, []).extend(values)

    def close(self):
        pass


def results():
    """Five steps of 128 real tokens (96 loss tokens), the third one skipped (non-finite)."""
    return [
        StepResult(s, 5.0 - s / 4, 0.5 + s, 1e-3 * s, 0.25, s == 3, 128, 96) for s in range(1, 6)
    ]


def run_steps(bar: bool) -> tuple[RunProgress, Scalars]:
    cfg = tiny_config(steps=5)  # global batch 8 x seq 16 = 128 tokens per step
    cfg.metrics.progress_bar, cfg.metrics.log_every = bar, 2
    writer = Scalars()
    mesh = SimpleNamespace(device=torch.device("cpu"), layout=RunLayout.build(cfg, 1))
    progress = RunProgress(cfg, mesh, writer)
    for r in results():
        progress.step(r, {"memory/tensors_peak_gib": 0.5} if r.step == 1 else {})
        if r.step in (4, 5):  # train.eval_every 4, and the last step
            progress.validation(r.step, 2.0 + r.step / 100, 7.5)
        progress.show(r)
    progress.close()
    return progress, writer


def test_line_mode_prints_logged_and_validated_steps(one_rank, capsys):
    progress, writer = run_steps(bar=True)  # stderr is no terminal here: lines, not a bar
    assert capsys.readouterr().out.splitlines() == [
        "step 2/5  loss 4.5000  lr 2.00e-03  grad_norm 2.500  tok_s 512",
        "step 3: non-finite loss/grad norm, update skipped",
        "step 4/5  loss 4.0000  lr 4.00e-03  grad_norm 4.500  tok_s 512  val_loss 2.0400  "
        "val_ppl 7.50",
        "step 5/5  loss 3.7500  lr 5.00e-03  grad_norm 5.500  tok_s 512  val_loss 2.0500  "
        "val_ppl 7.50",
    ]
    train = [
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/loss_tokens_per_s",
    ]
    train += ["perf/step_time_s", "perf/tflops_per_rank", "memory/peak_gib"]
    assert writer.logged == {
        1: ["memory/tensors_peak_gib"],
        2: train,
        3: [],
        4: train + ["val/loss", "val/ppl"],
        5: train + ["val/loss", "val/ppl"],
    }
    assert progress.losses == [r.loss for r in results()]
    assert progress.times == [0.25] * 5
    assert progress.evals == [
        {"step": 4, "loss": 2.04, "ppl": 7.5},
        {"step": 5, "loss": 2.05, "ppl": 7.5},
    ]


def test_without_a_bar_the_validation_has_its_own_line(one_rank, capsys):
    run_steps(bar=False)
    assert capsys.readouterr().out.splitlines() == [
        "step 3: non-finite loss/grad norm, update skipped",
        "step 4: val/loss 2.0400, val/ppl 7.50",
        "step 5: val/loss 2.0500, val/ppl 7.50",
    ]


def test_the_plan_is_printed_at_the_start_and_beside_the_measurement_at_the_end():
    plan = {"hardware": "cpu", "step_s": 0.3, "peak_bytes": 3 * 2**29, "guess": "a guess"}
    assert describe_plan(plan) == (
        "plan (cpu profile): predicted 0.3 s/step, 1.5 GiB peak per rank; a guess"
    )
    assert describe_plan({"hardware": "h100", "error": "no fit"}) == (
        "plan (h100): no prediction: no fit"
    )
    measured = against_plan(plan, [0.2, 0.3], [2**30, 2**31], on_cuda=False)
    assert plan == {"hardware": "cpu", "step_s": 0.3, "peak_bytes": 3 * 2**29, "guess": "a guess"}
    assert list(measured) == [
        *plan,
        "measured_step_s",
        "step_error",
        "measured_peak_bytes",
        "peak_error",
        "peak_measured_as",
    ]
    summary = {
        "steps": 2,
        "losses": [5.0, 4.0],
        "first_loss": 5.0,
        "last_loss": 4.0,
        "val_loss": None,
        "data": {"kind": "text"},
        "tokens_per_s": 1234.5,
        "loss_tokens_per_s": 567.8,
        "plan": measured,
        "time_s": 3.21,
        "peak_memory_bytes_per_rank": [3 * 2**29, 2**30],
        "run_dir": "runs/x",
    }
    assert format_summary(summary).splitlines() == [
        "summary",
        "  steps          2",
        "  loss           5.0000 -> 4.0000",
        "  tokens/s       1,234 (real tokens, no padding), loss tokens/s 568",
        "  planned        0.3 s/step against 0.25 measured (+20%, uncalibrated), 1.5 GiB/rank "
        "against 2 measured (-25%, tensors, profile.memory)",
        "  time           3.2 s",
        "  peak MiB/rank  1536, 1024",
        "  run dir        runs/x",
    ]
    untested = against_plan(plan, [0.3], [None], on_cuda=False)
    assert "tensors not measured" in format_summary({**summary, "plan": untested})


def test_skipped_updates_get_one_summary_line_only_when_there_are_any():
    """train.on_nonfinite=skip used to end with exit 0 and no count of the skipped updates:
    the closing lines name them (as ranges, shortened), and a run that skipped none prints
    the lines it always did."""
    summary = {
        "steps": 12,
        "first_step": 5,  # a resumed launch: steps 5..12 are its 8 updates
        "losses": [5.0, 4.0],
        "first_loss": 5.0,
        "last_loss": 4.0,
        "tokens_per_s": 1234.5,
        "time_s": 3.21,
        "peak_memory_bytes_per_rank": [2**30],
        "run_dir": "runs/x",
    }
    plain = format_summary(summary).splitlines()
    assert format_summary({**summary, "skipped_steps": []}).splitlines() == plain
    lines = format_summary({**summary, "skipped_steps": [6, 7, 8, 9, 10, 11, 12]}).splitlines()
    assert lines == [
        *plain[:3],
        "  skipped        7 of 8 updates (non-finite): steps 6-12",
        *plain[3:],
    ]
    scattered = {**summary, "steps": 20, "skipped_steps": [5, 7, 9, 10, 11, 13, 15, 17, 19]}
    assert format_summary(scattered).splitlines()[3] == (
        "  skipped        9 of 16 updates (non-finite): steps 5, 7, 9-11, 13, ..., 17, 19"
    )
