"""Worker: build the model on a (dp, tp) mesh with --checkpoint.init_from dcp: and hf:, run a
forward pass, gather logits and every parameter; rank 0 saves them with the bytes each rank read.

usage: hf_load.py OUT TOKENS DP TP NAME HF_DIR DCP_DIR [NAME HF_DIR DCP_DIR ...]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybrid2d.checkpoint.hf import last_load_report, model_config_from_hf
from hybrid2d.config import JobConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main():
    out, tokens_path, dp, tp = sys.argv[1:5]
    dp, tp = int(dp), int(tp)
    cases = sys.argv[5:]
    tokens = torch.load(tokens_path)
    init_distributed("cpu", 300)
    from hybrid2d.trainer import build_model

    mesh = None
    results = {}
    for i in range(0, len(cases), 3):
        name, hf_dir, dcp_dir = cases[i : i + 3]
        with open(os.path.join(hf_dir, "config.json")) as f:
            model_cfg = model_config_from_hf(json.load(f))
        for spec in (f"dcp:{dcp_dir}", f"hf:{hf_dir}"):
            cfg = JobConfig(recipe="test")
            cfg.model = model_cfg
            cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
            cfg.train.seq_len = tokens.shape[1]
            cfg.train.global_batch = dp
            cfg.checkpoint.init_from = spec
            layout = RunLayout.build(cfg, dist.get_world_size())
            mesh = build_mesh("cpu", layout) if mesh is None else mesh.with_layout(layout)
            model = build_model(cfg, mesh).eval()
            with torch.no_grad():
                logits = full(model(tokens)).clone()
            params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
            report = last_load_report()
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, (report.bytes_read, report.checkpoint_bytes))
            results[(name, spec.split(":")[0])] = {
                "logits": logits,
                "params": params,
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "bytes_read": [b for b, _ in per_rank],
                "checkpoint_bytes": per_rank[0][1],
            }
            del model
    if dist.get_rank() == 0:
        torch.save(results, out)
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
