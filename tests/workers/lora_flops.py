"""Worker: the matmul FLOPs rank 0 executes in one LoRA step on tp = 2 (dp 1), counted by torch's
FlopCounterMode, for each (targets, kv heads) given; tests/test_plan_lora.py compares them with
the planner's per-rank count.

usage: lora_flops.py OUT TARGETS:KV [...]
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.trainer import Trainer
from tests.lora_reference import lora_job, lora_settings, tp4_model


def counted(targets: str, kv: int) -> int:
    model = dataclasses.replace(tp4_model(), n_kv_heads=kv)
    cfg = lora_job(model, lora_settings(targets=targets))
    cfg.parallel.tp, cfg.parallel.dp_shard = 2, 1
    trainer = Trainer(cfg, build_mesh("cpu", RunLayout.build(cfg, 2)))
    seq = cfg.train.seq_len
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.vocab_size, (cfg.train.global_batch, seq + 1), generator=gen)
    batch = [(x[:, :-1], x[:, 1:])]
    trainer.train_step(batch)  # FSDP's and the optimizer's first-step work out of the count
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        trainer.train_step(batch)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)


def main():
    out, *specs = sys.argv[1:]
    init_distributed("cpu", 120, "auto")
    results = {}
    for spec in specs:
        targets, kv = spec.rsplit(":", 1)
        results[spec] = counted(targets, int(kv))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
