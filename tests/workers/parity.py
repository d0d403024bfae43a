"""Worker: train a tiny model on a (dp, tp) mesh on fixed global batches; rank 0 saves results.

usage: parity.py OUT DP TP OPTIMIZER GRAD_CLIP [DP_REPLICATE [--section.key value ...]]
"""

import os
import sys

import torch
import torch.distributed as dist

from hybrid2d import shm_backend
from hybrid2d.cli import apply_overrides
from hybrid2d.config import JobConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from tests.reference import global_batches, tiny_config


def check_node_layout(mesh):
    """Launched as several nodes: every tp group inside one node, data parallel across nodes."""
    node = os.environ["GROUP_RANK"]

    def nodes_of(sub):
        seen = [None] * sub.size()
        dist.all_gather_object(seen, node, group=sub.get_group())
        return set(seen)

    assert len(nodes_of(mesh.tp_mesh)) == 1, "a tp group spans nodes"
    assert len(nodes_of(mesh.dp_mesh)) > 1, "data parallelism does not span the nodes"


def main():
    out, dp, tp, optimizer, clip = sys.argv[1:6]
    dp_rep = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    cfg: JobConfig = tiny_config(optimizer=optimizer, grad_clip=float(clip))
    apply_overrides(cfg, sys.argv[7:])  # e.g. --train.micro_batch 1
    cfg.parallel.tp = int(tp)
    cfg.parallel.dp_replicate = dp_rep
    cfg.parallel.dp_shard = int(dp) // dp_rep
    world = int(dp) * int(tp)
    layout = RunLayout.build(cfg, world)
    init_distributed("cpu", 120, cfg.parallel.shm_collectives)
    from hybrid2d.trainer import Trainer

    mesh = build_mesh("cpu", layout)
    if os.environ.get("CHECK_NODES"):
        check_node_layout(mesh)
    trainer = Trainer(cfg, mesh)
    groups = {"tp": mesh.tp_mesh.get_group(), "dp": mesh.mesh["dp_shard"].get_group()}
    counts = []  # collectives served by shared memory per axis, after each step
    losses, norms = [], []
    per_rank = cfg.train.global_batch // mesh.dp
    for inputs, labels in global_batches(cfg):
        lo = mesh.dp_rank * per_rank
        mb = cfg.train.micro_batch or per_rank
        micro = [(inputs[i : i + mb], labels[i : i + mb]) for i in range(lo, lo + per_rank, mb)]
        r = trainer.train_step(micro)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        counts.append({k: shm_backend.collective_count(g) for k, g in groups.items()})
    params = {}
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().clone()
    # Collectives through shared memory per step after the first (which also grows slots).
    shm = {k: (counts[-1][k] - counts[0][k]) / (len(counts) - 1) for k in groups if counts[-1][k]}
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "norms": norms, "params": params, "shm": shm}, out)
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
