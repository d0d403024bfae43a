"""Two launchers on one host acting as two nodes of 2 ranks, and HSDP, against one process."""

import os
import subprocess
import sys

import pytest
import torch

from tests.launch import REPO, check_ok, free_port, launcher_env, run_ranks
from tests.reference import tiny_config, train_single_process
from tests.test_parity import assert_matches

pytestmark = pytest.mark.slow


def two_node_launch(tmp_path, launcher: str, dp: int, tp: int, dp_replicate: int):
    out = tmp_path / "out.pt"
    port = free_port()
    worker = [
        "tests/workers/parity.py",
        str(out),
        str(dp),
        str(tp),
        "sgd",
        "0.5",
        str(dp_replicate),
    ]
    env = launcher_env(
        CHECK_NODES="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    nodes = []
    for node in (0, 1):
        if launcher == "accelerate":
            cmd = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--multi_gpu",
                "--num_machines",
                "2",
                "--machine_rank",
                str(node),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--num_processes",
                "4",
                *worker,
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                *worker,
            ]
        nodes.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    for p in nodes:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
    return torch.load(out)


@pytest.mark.parametrize(
    "launcher,dp,tp,dp_replicate",
    [("accelerate", 2, 2, 1), ("torchrun", 2, 2, 2)],
    ids=["accelerate-fsdp2xtp2", "torchrun-hsdp2x1xtp2"],
)
def test_two_nodes_match_single_process(tmp_path, launcher, dp, tp, dp_replicate):
    got = two_node_launch(tmp_path, launcher, dp, tp, dp_replicate)
    assert_matches(got, train_single_process(tiny_config("sgd", 0.5)))


@pytest.mark.parametrize("optimizer,clip", [("sgd", 0.5), ("adamw", 1.0)])
def test_hsdp_matches_single_process(tmp_path, optimizer, clip):
    """dp_replicate=2 x dp_shard=2 (tp=1): HSDP on one host, 4 ranks."""
    out = tmp_path / "hsdp.pt"
    args = ["tests/workers/parity.py", str(out), "4", "1", optimizer, str(clip), "2"]
    check_ok(run_ranks(4, args))
    assert_matches(torch.load(out), train_single_process(tiny_config(optimizer, clip)))
