"""Two launchers on one host acting as two nodes of 2 ranks, and HSDP, against one process."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from tests.launch import (
    REPO,
    check_ok,
    host_store,
    launcher_env,
    rendezvous_args,
    reserved_port,
    run_ranks,
)
from tests.reference import tiny_config, train_single_process
from tests.test_parity import assert_matches

pytestmark = pytest.mark.slow


def two_node_launch(tmp_path, launcher: str, dp: int, tp: int, dp_replicate: int):
    """torchrun: both launchers join a rendezvous this process hosts (the workers' store is on a
    port node 0's agent binds itself). accelerate must be told node 0's port: this process holds
    it (`reserved_port`) until node 0's store takes it over, so no other job can be given it."""
    worker = [
        "tests/workers/parity.py",
        str(tmp_path / "out.pt"),
        str(dp),
        str(tp),
        "sgd",
        "0.5",
        str(dp_replicate),
    ]
    env = launcher_env(
        CHECK_NODES="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    store = host_store() if launcher == "torchrun" else None
    with reserved_port() if store is None else contextlib.nullcontext() as port:
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
                    *rendezvous_args(store),
                    *worker,
                ]
            nodes.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            for node, p in enumerate(nodes):
                _, err = p.communicate(timeout=300)
                assert p.returncode == 0, f"node {node}: {err[-4000:]}"
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return torch.load(tmp_path / "out.pt")


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
