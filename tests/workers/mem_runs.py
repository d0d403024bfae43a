"""Worker: train several models in one launch (one process group; one DeviceMesh per mesh
shape), two steps each, measuring each step's memory. Every rank writes
OUT/{file_name(run)}-rank{r}.json: {"steps": [step 1, step 2]}, and for llama-debug runs also
"torch_fsdp_mem_tracker_peak", the peak of a third step under PyTorch's FSDPMemTracker.

usage: mem_runs.py OUT RUN [RUN ...]
RUN:  llama-debug@DPxTP[:AC]   the recipe as it is defined, activation checkpointing AC
      FAMILY@DPxTP             tests/family_shapes.py's tiny model of FAMILY at llama-debug's width
      lora@DPxTP:BASE_DTYPE[:TARGETS:DROPOUT[:AC]]   llama-debug with adapters, e.g.
          lora@2x2:bf16, lora@2x2:fp32:q_proj,v_proj:0.1, lora@4x1:bf16:::selective
          (defaults: all-linear, no dropout, no checkpointing)
Every run's mesh has the launch's world size.

One launch instead of one per mesh or model: most of a small launch is starting its ranks.
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
from tests.family_shapes import family_model


def parse_mesh(text: str) -> tuple[int, int]:
    dp, tp = map(int, text.split("x"))
    return dp, tp


def llama_debug_config(dp: int, tp: int, ac: str = "none") -> JobConfig:
    """llama-debug as the recipe defines it (micro batch: the whole per-rank batch), fp32 CPU,
    with activation checkpointing `ac`."""
    cfg = recipes.get("llama-debug")
    cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
    cfg.parallel.activation_checkpoint = ac
    cfg.train.device = "cpu"
    RunLayout.build(cfg, dp * tp)  # the settings fit this mesh
    return cfg


def family_config(family: str, dp: int, tp: int) -> JobConfig:
    """A family's small model (llama-debug's size, where activations outweigh the per-op
    transients), fp32 CPU, sequences longer than its window, 4 samples per rank."""
    cfg = JobConfig(model=family_model(family, dim=128, ffn_dim=352, vocab_size=2048))
    cfg.train.device = "cpu"
    cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
    cfg.train.seq_len, cfg.train.global_batch = 128, 4 * dp
    RunLayout.build(cfg, dp * tp)
    return cfg


def lora_config(spec: str) -> JobConfig:
    """llama-debug with rank-6 adapters (FSDP pads A's 6 rows over 4 ranks) on every linear
    layer of a block, or on some with dropout, fp32 CPU compute (a bf16 base computes in bf16,
    as PEFT over a bf16 model does), AdamW. spec: DPxTP:BASE_DTYPE[:TARGETS:DROPOUT[:AC]]."""
    mesh, base_dtype, *more = spec.split(":")
    dp, tp = parse_mesh(mesh)
    targets, dropout, ac = [*more, *("", "0", "")[len(more) :]]
    cfg = recipes.get("llama-debug")
    cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
    cfg.train.device = "cpu"
    cfg.parallel.activation_checkpoint = ac or "none"
    cfg.lora = LoraConfig(6, 16.0, float(dropout or 0), targets or "all-linear", base_dtype)
    RunLayout.build(cfg, dp * tp)
    return cfg


def config(run: str) -> JobConfig:
    """The settings of one RUN (see the module doc)."""
    name, spec = run.split("@")
    if name == "lora":
        return lora_config(spec)
    mesh, *ac = spec.split(":")
    if name == "llama-debug":
        return llama_debug_config(*parse_mesh(mesh), *ac)
    return family_config(name, *parse_mesh(mesh))


def file_name(run: str, rank: int) -> str:
    safe = run.replace("@", "-").replace(":", "-").replace(",", "+")
    return f"{safe}-rank{rank}.json"


def rank_batches(cfg: JobConfig, mesh):
    """This dp rank's batches (its tp peers draw the same): random tokens seeded by dp rank."""
    t = cfg.train
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    while True:
        tokens = torch.randint(
            0, cfg.model.vocab_size, (t.global_batch // mesh.dp, t.seq_len + 1), generator=gen
        )
        yield [(tokens[:, :-1], tokens[:, 1:])]


def main():
    out, *runs = sys.argv[1:]
    init_distributed("cpu", 300)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from hybrid2d.profiling.measure import measure_step
    from hybrid2d.trainer import Trainer

    meshes = {}  # (dp, tp) -> the DeviceMesh every run of that shape trains on
    for run in runs:
        cfg = config(run)
        layout = RunLayout.build(cfg, dist.get_world_size())
        shape = (cfg.parallel.dp_shard, cfg.parallel.tp)
        if shape not in meshes:
            meshes[shape] = build_mesh("cpu", layout)
        mesh = meshes[shape].with_layout(layout)
        trainer = Trainer(cfg, mesh)
        batches = rank_batches(cfg, mesh)
        result = {"steps": []}
        for step in (1, 2):
            with measure_step(trainer.model, trainer.optimizer, step, dist.get_rank()) as res:
                trainer.train_step(next(batches))
            result["steps"].append(res[0].to_dict())
        if run.startswith("llama-debug@"):
            with FSDPMemTracker(trainer.model, trainer.optimizer) as fmt:
                trainer.train_step(next(batches))
            peak = fmt.get_tracker_snapshot("peak")
            result["torch_fsdp_mem_tracker_peak"] = sum(dev["Total"] for dev in peak.values())
        with open(os.path.join(out, file_name(run, dist.get_rank())), "w") as f:
            json.dump(result, f)
        del trainer, mesh, batches
        gc.collect()
    shutdown_distributed()  # barrier first: no rank tears gloo down under a peer


if __name__ == "__main__":
    main()
