"""The README's main job, shortened: accelerate launch with the CPU 2x2 config."""

import json
import subprocess
import sys

import pytest

from tests.launch import REPO, launcher_env, retry_if_port_taken

pytestmark = pytest.mark.slow

SCALARS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "perf/tokens_per_s",
    "perf/step_time_s",
    "memory/peak_gib",
    "balance/compute_max_over_median",
    "ranks/compute_s/3",
}


def test_accelerate_launch_2x2_trains(tmp_path):
    run_dir = tmp_path / "run"
    env = launcher_env()
    proc = retry_if_port_taken(  # accelerate picks the port (0) and checks it is free
        lambda: subprocess.run(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                "recipes/accelerate/cpu_2x2.yaml",
                "--main_process_port",
                "0",
                "recipes/llama.py",
                "--train.steps",
                "20",
                "--metrics.run_dir",
                str(run_dir),
                "--data.cache_dir",
                str(tmp_path / "cache"),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "dp_shard=2 x tp=2" in proc.stdout
    # A log file gets a line per step (stderr is no terminal), and no Python warning.
    assert "step 20/20  loss " in proc.stdout
    assert "Warning" not in proc.stderr and "\r" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    losses = summary["losses"]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert len(summary["peak_memory_bytes_per_rank"]) == 4
    # The step breakdown of every rank, on every logged step (log_every 1), and its aggregate.
    balance = [json.loads(x) for x in (run_dir / "balance.jsonl").read_text().splitlines()]
    assert [b["step"] for b in balance] == list(range(1, 21))
    assert all(len(b["ranks"]) == 4 for b in balance)
    assert [r["rank"] for r in summary["balance"]["ranks"]] == [0, 1, 2, 3]
    assert "  balance        compute max/median " in proc.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert SCALARS <= tags, tags
    logged = [e.value for e in acc.Scalars("train/loss")]
    assert logged == pytest.approx(losses, rel=1e-6)
