"""Worker: train llama-debug on a (dp, tp) mesh for a few steps, measuring each step's memory;
then one more step under PyTorch's own FSDPMemTracker. Every rank writes OUT/rank{r}.json.

usage: mem_steps.py OUT DP TP [STEPS]
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid2d import recipes
from hybrid2d.config import JobConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed


def config(dp: int, tp: int, ac: str = "none") -> JobConfig:
    """llama-debug as the recipe defines it (micro batch: the whole per-rank batch), fp32 CPU,
    with activation checkpointing `ac`."""
    cfg = recipes.get("llama-debug")
    cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
    cfg.parallel.activation_checkpoint = ac
    cfg.train.device = "cpu"
    RunLayout.build(cfg, dp * tp)  # the settings fit this mesh
    return cfg


def main():
    out, dp, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    cfg = config(dp, tp, sys.argv[5] if len(sys.argv) > 5 else "none")
    init_distributed("cpu", 300)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from hybrid2d.profiling.measure import measure_step
    from hybrid2d.trainer import Trainer

    mesh = build_mesh("cpu", RunLayout.build(cfg, dp * tp))
    trainer = Trainer(cfg, mesh)
    t = cfg.train
    gen = torch.Generator().manual_seed(mesh.dp_rank)

    def batch():
        tokens = torch.randint(
            0, cfg.model.vocab_size, (t.global_batch // dp, t.seq_len + 1), generator=gen
        )
        return [(tokens[:, :-1], tokens[:, 1:])]

    records = []
    for step in range(1, steps + 1):
        with measure_step(trainer.model, trainer.optimizer, step, dist.get_rank()) as res:
            trainer.train_step(batch())
        records.append(res[0].to_dict())
    fmt = FSDPMemTracker(trainer.model, trainer.optimizer)
    with fmt:
        trainer.train_step(batch())
    peak = fmt.get_tracker_snapshot("peak")
    torch_peak = sum(dev["Total"] for dev in peak.values())
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"steps": records, "torch_fsdp_mem_tracker_peak": torch_peak}, f)
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
