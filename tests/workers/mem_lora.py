"""Worker: LoRA training of llama-debug on several (dp, tp) meshes and base dtypes in one launch,
measuring each step's memory. Every rank writes OUT/{spec}-rank{r}.json.

usage: mem_lora.py OUT SPEC [SPEC ...]
SPEC: DPxTP:BASE_DTYPE[:TARGETS:DROPOUT[:AC]], e.g. 2x2:bf16, 2x2:fp32:q_proj,v_proj:0.1 or
4x1:bf16:::selective (all-linear, no dropout, selective checkpointing)
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid2d import recipes
from hybrid2d.config import JobConfig, LoraConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed


def config(spec: str) -> JobConfig:
    """llama-debug with rank-6 adapters (FSDP pads A's 6 rows over 4 ranks) on every linear
    layer of a block, or on some with dropout, fp32 CPU compute (a bf16 base computes in bf16,
    as PEFT over a bf16 model does), AdamW. spec: DPxTP:BASE_DTYPE[:TARGETS:DROPOUT[:AC]]."""
    dp, tp, base_dtype, targets, dropout, ac = parse(spec)
    cfg = recipes.get("llama-debug")
    cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
    cfg.train.device = "cpu"
    cfg.parallel.activation_checkpoint = ac
    cfg.lora = LoraConfig(6, 16.0, dropout, targets, base_dtype)
    RunLayout.build(cfg, dp * tp)  # the settings fit this mesh
    return cfg


def parse(spec: str) -> tuple[int, int, str, str, float, str]:
    mesh, base_dtype, *more = spec.split(":")
    dp, tp = map(int, mesh.split("x"))
    targets, dropout, ac = [*more, *("", "0", "")[len(more) :]]
    return dp, tp, base_dtype, targets or "all-linear", float(dropout or 0), ac or "none"


def file_name(spec: str) -> str:
    return spec.replace(":", "-").replace(",", "+")


def main():
    out, *specs = sys.argv[1:]
    init_distributed("cpu", 300)
    from hybrid2d.profiling.measure import measure_step
    from hybrid2d.trainer import Trainer

    for spec in specs:
        dp, tp, *_ = parse(spec)
        cfg = config(spec)
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
        name = file_name(spec)
        with open(os.path.join(out, f"{name}-rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"steps": records}, f)
        del trainer, mesh
        gc.collect()
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
