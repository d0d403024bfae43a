"""Worker: for each named family's tiny model (tests/family_shapes.py), train a few steps on a
(dp, tp) mesh measuring each step's memory. Every rank writes OUT/{family}-rank{r}.json.

usage: mem_families.py OUT DP TP FAMILY[,FAMILY...] [KEY=VALUE ...]
(KEY=VALUE: model shape changes for every family, e.g. n_kv_heads=1)
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid2d.config import JobConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from tests.family_shapes import family_model


def config(family: str, dp: int, tp: int, **changes) -> JobConfig:
    """A family's small model (llama-debug's size, where activations outweigh the per-op
    transients), fp32 CPU, sequences longer than its window, 4 samples per rank."""
    shape = dict(dim=128, ffn_dim=352, vocab_size=2048) | changes
    cfg = JobConfig(model=family_model(family, **shape))
    cfg.train.device = "cpu"
    cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
    cfg.train.seq_len, cfg.train.global_batch = 128, 4 * dp
    RunLayout.build(cfg, dp * tp)  # the settings fit this mesh
    return cfg


def main():
    out, dp, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    families = sys.argv[4].split(",")
    changes = {k: int(v) for k, v in (a.split("=") for a in sys.argv[5:])}
    init_distributed("cpu", 300)
    from hybrid2d.profiling.measure import measure_step
    from hybrid2d.trainer import Trainer

    for family in families:
        cfg = config(family, dp, tp, **changes)
        mesh = build_mesh("cpu", RunLayout.build(cfg, dp * tp))
        trainer = Trainer(cfg, mesh)
        t = cfg.train
        gen = torch.Generator().manual_seed(mesh.dp_rank)
        records = []
        for step in (1, 2):
            tokens = torch.randint(
                0, cfg.model.vocab_size, (t.global_batch // dp, t.seq_len + 1), generator=gen
            )
            with measure_step(trainer.model, trainer.optimizer, step, dist.get_rank()) as res:
                trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
            records.append(res[0].to_dict())
        with open(os.path.join(out, f"{family}-rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"steps": records}, f)
        del trainer, mesh
        gc.collect()
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
