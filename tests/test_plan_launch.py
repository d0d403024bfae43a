"""The planner inside a run: the prediction beside the measurement, and parallel.plan=auto."""

import json
import subprocess
import sys

import pytest

from hybrid2d import recipes
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.planner.launch import auto_plan, guess_note, profile_for
from hybrid2d.planner.search import best_plan
from tests.launch import REPO, launcher_env


def test_auto_plan_takes_the_best_plan():
    hw = profile_for("h100", "cpu")
    cfg = recipes.get("llama3.1-8b")
    choices, line = auto_plan(cfg, 8, 8, hw, set())
    best = best_plan(recipes.get("llama3.1-8b"), 8, 8, hw)
    layout = RunLayout.build(cfg, 8, **choices)
    assert layout.mesh_shape == (best.dp_replicate, best.dp_shard, best.tp)
    assert (layout.activation_checkpoint, layout.micro_batch) == (
        best.activation_checkpoint,
        best.micro_batch,
    )
    assert f"tp={best.tp}" in line and f"micro batch {best.micro_batch}" in line


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA L40S"])
def test_a_gpu_without_a_preset_is_called_a_guess(monkeypatch, gpu):
    """An L40S used to be priced as an H100 without a word; a known GPU's preset is no guess."""
    import torch

    class Props:
        total_memory = 48 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    hw = profile_for("", "cuda")
    assert hw.name == "h100" and hw.memory_bytes == 48 * 2**30
    note = guess_note(hw)
    if "L40S" in gpu:
        assert note.startswith("NVIDIA L40S has no preset: h100's figures, a guess;"), note
        assert "--calibrate --device cuda" in note
    else:
        assert note == ""


def test_auto_plan_refuses_settings_it_would_override():
    cfg = recipes.get("llama3.1-8b")
    with pytest.raises(ConfigError, match="parallel.plan=auto chooses parallel.tp"):
        auto_plan(cfg, 8, 8, profile_for("h100", "cpu"), {"parallel.tp"})


def test_auto_plan_refuses_mesh_sizes_from_the_accelerate_config(monkeypatch):
    """accelerate's parallelism_config (PARALLELISM_CONFIG_* variables) counts as setting the
    sizes, as --parallel.tp does: plan auto refuses it rather than silently replacing tp 2."""
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.delenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", raising=False)
    cfg = recipes.get("llama-debug")
    with pytest.raises(ConfigError) as e:
        auto_plan(cfg, 4, 4, profile_for("cpu", "cpu"), set())
    message = str(e.value)
    assert message.startswith("parallel.plan=auto chooses parallel.tp, parallel.dp_shard, but")
    assert "parallelism_config_tp_size=2, parallelism_config_dp_shard_size=2" in message
    assert "\n" not in message
    # without them (or with them empty, as launcher_sizes reads them) it plans
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "")
    monkeypatch.delenv("PARALLELISM_CONFIG_DP_SHARD_SIZE")
    assert auto_plan(cfg, 4, 4, profile_for("cpu", "cpu"), set())[1].startswith("plan auto")


def test_auto_plan_with_an_accelerate_mesh_is_one_error_line():
    env = launcher_env(PARALLELISM_CONFIG_TP_SIZE="2", PARALLELISM_CONFIG_DP_SHARD_SIZE="2")
    proc = subprocess.run(
        [sys.executable, "recipes/llama.py", "--parallel.plan", "auto", "--train.steps", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: parallel.plan=auto chooses"), lines
    assert "parallelism_config_tp_size=2" in lines[0]


def test_unknown_profile_is_one_error_line():
    proc = subprocess.run(
        [sys.executable, "recipes/llama.py", "--parallel.plan_hardware", "h1000"],
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallel.plan_hardware='h1000'")


@pytest.mark.slow
def test_run_prints_and_records_prediction_and_measurement(tmp_path):
    """With --parallel.plan auto on CPU: what auto chose, the prediction at the start and the
    measurement beside it at the end, both in summary.json."""
    cmd = [
        sys.executable,
        str(REPO / "recipes/llama.py"),
        "--parallel.plan",
        "auto",
        "--train.steps",
        "8",
        "--checkpoint.save_final",
        "false",
        "--metrics.progress_bar",
        "false",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan auto (cpu): dp_replicate=1 x dp_shard=1 x tp=1" in proc.stdout
    assert "plan (cpu profile): predicted" in proc.stdout
    # The CPU profile is a guess until calibrated: the lines say so and how to measure.
    assert "uncalibrated; measure this machine with tools/plan.py --calibrate" in proc.stdout
    planned = next(ln for ln in proc.stdout.splitlines() if ln.startswith("  planned        "))
    assert " measured (" in planned and ", uncalibrated)" in planned, planned
    summary = json.loads(next(tmp_path.glob("runs/*/summary.json")).read_text())
    plan = summary["plan"]
    assert plan["hardware"] == "cpu" and plan["step_s"] > 0 and plan["peak_bytes"] > 0
    assert plan["guess"].startswith("this host (") and "--calibrate" in plan["guess"]
    # On CPU the run's peak is process RSS, which the tensor estimate is not compared with.
    assert "peak_error" not in plan and "tensors not measured" in proc.stdout
    assert plan["step_error"] == pytest.approx(plan["step_s"] / plan["measured_step_s"] - 1)
