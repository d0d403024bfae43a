"""Worker: a 2x2 trainer on a machine without shared memory (simulated); rank 0 writes JSON.

With parallel.shm_collectives=on every rank must stop with one ConfigError; with auto the run
trains over gloo and says so.

usage: shm_unavailable.py OUT SETTING
"""

import json
import sys

import torch.distributed as dist

from hybrid2d.config import ConfigError
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.parallel import shm_comm
from tests.reference import global_batches, tiny_config


def main():
    out, setting = sys.argv[1], sys.argv[2]
    shm_comm.unavailable_reason = lambda: "simulated: no /dev/shm"
    cfg = tiny_config("sgd", 1.0, steps=1)
    cfg.parallel.tp, cfg.parallel.dp_shard, cfg.parallel.shm_collectives = 2, 2, setting
    init_distributed("cpu", 60)
    from hybrid2d.trainer import Trainer

    mesh = build_mesh("cpu", 1, 2, 2)
    result = {}
    try:
        trainer = Trainer(cfg, mesh)
        per = cfg.train.global_batch // mesh.dp
        x, y = next(iter(global_batches(cfg)))
        lo = mesh.dp_rank * per
        result["loss"] = trainer.train_step([(x[lo : lo + per], y[lo : lo + per])]).loss
    except ConfigError as e:
        result["error"] = str(e)
    result["transports"] = len(shm_comm._TRANSPORTS)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
