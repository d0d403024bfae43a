"""Bad settings: one line naming the setting, non-zero exit, before any process group."""

import os
import subprocess
import sys

import pytest

from hybrid2d import recipes
from hybrid2d.config import ConfigError, JobConfig, apply_overrides
from tests.launch import REPO


def run_cli(*args, world=1, local_world=None, timeout=60):
    env = dict(
        os.environ, WORLD_SIZE=str(world), RANK="0", LOCAL_WORLD_SIZE=str(local_world or world)
    )
    env.pop("MASTER_ADDR", None)
    return subprocess.run(
        [sys.executable, "recipes/llama.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, world, expect",
    [
        (["--parallel.tp", "3", "--parallel.dp_shard", "1"], 3, "model.n_heads"),
        (["--parallel.tp", "2", "--parallel.dp_shard", "3"], 4, "world size 4"),
        (["--parallel.tp", "3"], 4, "world size 4"),
        (
            [
                "--parallel.tp",
                "8",
                "--model.n_kv_heads",
                "2",
                "--model.n_heads",
                "16",
                "--model.dim",
                "512",
            ],
            8,
            "model.n_kv_heads",
        ),
        (["--parallel.tp", "2", "--model.ffn_dim", "689"], 2, "model.ffn_dim"),
        (["--parallel.tp", "2", "--model.vocab_size", "4095"], 2, "model.vocab_size"),
        (["--parallel.tp", "2", "--train.seq_len", "255"], 2, "train.seq_len"),
        (["--train.global_batch", "6"], 4, "train.global_batch"),
        (["--train.micro_batch", "3"], 2, "train.micro_batch"),
        (["--train.stepz", "5"], 1, "--train.steps"),
        (["--train.steps", "five"], 1, "--train.steps"),
        (["--recipe", "llama3-8b"], 1, "llama3.1-8b"),
        (["--data.path", "/nonexistent/corpus.txt", "--train.steps", "1"], 1, "data.path"),
        (["--parallel.shm_collectives", "yes"], 1, "parallel.shm_collectives='yes'"),
    ],
)
def test_bad_setting_is_one_line(args, world, expect):
    line = error_line(run_cli(*args, world=world))
    assert expect in line


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"--parallel\.tp"):
        apply_overrides(JobConfig(), ["--parallel.tpp", "2"])


def test_overrides_set_typed_values():
    cfg = JobConfig()
    changed = apply_overrides(
        cfg, ["--parallel.tp", "2", "--train.lr=0.5", "--checkpoint.async_save", "true"]
    )
    assert (cfg.parallel.tp, cfg.train.lr, cfg.checkpoint.async_save) == (2, 0.5, True)
    assert changed == {"parallel.tp", "train.lr", "checkpoint.async_save"}


def test_tp_spanning_nodes_warns(monkeypatch):
    from hybrid2d.mesh import tp_locality_warning

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "spans nodes" in tp_locality_warning(4)
    assert tp_locality_warning(2) is None


def test_launcher_env_sets_mesh(monkeypatch):
    from hybrid2d.mesh import apply_launcher_settings

    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    cfg = recipes.get("llama-debug")
    apply_launcher_settings(cfg, set())
    assert (cfg.parallel.tp, cfg.parallel.dp_shard) == (2, 2)
    cfg = recipes.get("llama-debug")
    apply_launcher_settings(cfg, {"parallel.tp"})  # the command line wins
    assert cfg.parallel.tp == 1


def test_list_shows_recipes_with_sizes():
    proc = run_cli("--list")
    assert proc.returncode == 0
    for name, size in [
        ("llama-debug", "5.0M"),
        ("llama3.2-1b", "1.24B"),
        ("llama3.1-8b", "8.03B"),
        ("llama3.1-70b", "70.55B"),
    ]:
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(name + " "))
        assert size in line and "tp=" in line


def test_published_shapes_fit_tp8():
    for name in ("llama3.1-8b", "llama3.1-70b"):
        cfg = recipes.get(name)
        assert cfg.validate(64) == (1, 8, 8)
