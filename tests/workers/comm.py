"""Worker: count one training step's collectives on a (dp, tp) mesh; rank 0 writes JSON.

usage: comm.py OUT DP TP MICRO_BATCH [MODEL_JSON]

MODEL_JSON: ModelConfig fields of the model to use instead of the tiny Llama. The JSON also
holds the planner's prediction for the same step ("analytic").
"""

import json
import sys

import torch.distributed as dist

from hybrid2d.comm_report import CollectiveCounter
from hybrid2d.config import ModelConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.planner.comm import analytic_step
from hybrid2d.trainer import Trainer
from tests.reference import global_batches, tiny_config


def main():
    out, dp, tp, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = tiny_config("sgd", 1.0, steps=2)
    cfg.parallel.tp, cfg.parallel.dp_shard, cfg.train.micro_batch = tp, dp, mb
    if len(sys.argv) > 5:
        cfg.model = ModelConfig(**json.loads(sys.argv[5]))
    layout = RunLayout.build(cfg, dp * tp)
    init_distributed("cpu", 60)
    mesh = build_mesh("cpu", layout)
    trainer = Trainer(cfg, mesh)
    per = cfg.train.global_batch // dp
    lo = mesh.dp_rank * per
    mb = mb or per
    for step, (x, y) in enumerate(global_batches(cfg)):
        micro = [(x[i : i + mb], y[i : i + mb]) for i in range(lo, lo + per, mb)]
        if step == 1:  # the second step: nothing lazily initialised any more
            with CollectiveCounter() as counter:
                trainer.train_step(micro)
        else:
            trainer.train_step(micro)
    local = cfg.train.global_batch // dp
    analytic = analytic_step(cfg.model, dp, tp, local, cfg.train.seq_len, local // mb)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({**counter.summary(), "analytic": analytic}, f)
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
