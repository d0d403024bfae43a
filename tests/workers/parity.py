"""Worker: train a tiny model on a (dp, tp) mesh on fixed global batches; rank 0 saves results.

usage: parity.py OUT DP TP OPTIMIZER GRAD_CLIP [DP_REPLICATE [--section.key value ...]]
       parity.py families OUT DP TP SPEC_JSON

The second form trains several models in one launch (one process group and DeviceMesh):
SPEC_JSON is a list of runs {"name", "model": ModelConfig fields, "settings": [--section.key
value ...], "save": dir, "resume": dir, "init_from": spec, "steps": n} (all but name and model
optional), each 10 SGD steps with clipping (or `steps`). With "save" the state after step 5 is
saved as a run directory `dir`; with "resume" the run starts from `dir`'s step 5 (saved on
another mesh) and trains steps 6 to 10; "init_from" loads the weights (hf:DIR, dcp:DIR). Rank 0
saves {name: {"losses", "norms", "params"}}.
"""

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid2d import shm_backend
from hybrid2d.checkpoint import layout as ckpt_layout
from hybrid2d.checkpoint.dcp import Checkpointer
from hybrid2d.cli import apply_overrides
from hybrid2d.config import JobConfig, ModelConfig
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


def full_params(model) -> dict:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def families():
    """Each run of the spec on this mesh; see the module doc."""
    from hybrid2d.trainer import Trainer

    out, dp, tp, runs = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
    init_distributed("cpu", 120)
    mesh = None
    results = {}
    for run in runs:
        cfg: JobConfig = tiny_config(optimizer="sgd", grad_clip=0.5)
        cfg.model = ModelConfig(**run["model"])
        apply_overrides(cfg, run.get("settings", []))
        cfg.parallel.tp, cfg.parallel.dp_shard = tp, dp
        cfg.checkpoint.init_from = run.get("init_from", "")
        layout = RunLayout.build(cfg, dp * tp)
        # One DeviceMesh for every run: only the layout's model differs.
        mesh = (
            build_mesh("cpu", layout) if mesh is None else dataclasses.replace(mesh, layout=layout)
        )
        trainer = Trainer(cfg, mesh, resuming="resume" in run)
        first = 0
        if "resume" in run:
            ckpt = Checkpointer(cfg, run["resume"], trainer.checkpoint_states())
            first = ckpt.load(ckpt_layout.final_dir(run["resume"], 5))
        losses, norms = [], []
        per_rank = cfg.train.global_batch // dp
        lo = mesh.dp_rank * per_rank
        for step, (inputs, labels) in enumerate(global_batches(cfg)):
            if step < first or step >= run.get("steps", cfg.train.steps):
                continue
            r = trainer.train_step([(inputs[lo : lo + per_rank], labels[lo : lo + per_rank])])
            losses.append(r.loss)
            norms.append(r.grad_norm)
            if step + 1 == 5 and "save" in run:
                Checkpointer(cfg, run["save"], trainer.checkpoint_states()).save(5)
        results[run["name"]] = {
            "losses": losses,
            "norms": norms,
            "params": full_params(trainer.model),
        }
    if dist.get_rank() == 0:
        torch.save(results, out)
    shutdown_distributed()


if __name__ == "__main__":
    families() if sys.argv[1] == "families" else main()
