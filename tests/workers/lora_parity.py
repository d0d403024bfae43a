"""Worker: LoRA training on several (dp, tp) meshes of one 4-rank launch, on fixed global
batches; rank 0 saves each mesh's losses, last-step adapter gradients, final adapters and base,
and the collectives of one more step next to those of full fine-tuning on the same mesh.

usage: lora_parity.py OUT DPxTP[:bf16][:compile][:kv2] [...]   (base dtype fp32 unless :bf16;
:compile: parallel.compile; :kv2: the model with 2 kv heads, replicated past tp 2, and its
trained adapters saved as a checkpoint in OUT.DPxTP-kv2)
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from hybrid2d.checkpoint.dcp import Checkpointer
from hybrid2d.comm_report import CollectiveCounter
from hybrid2d.config import LoraConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.parallel.lora import is_adapter
from hybrid2d.trainer import Trainer
from tests.lora_reference import lora_job, lora_settings, tp4_model
from tests.reference import global_batches


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def one_step_collectives(trainer: Trainer, inputs, labels) -> dict:
    with CollectiveCounter() as counter:
        trainer.train_step([(inputs, labels)])
    return {"counts": dict(counter.counts), "bytes": dict(counter.bytes)}


def train_on(
    dp: int, tp: int, base_dtype: str, compile: bool = False, kv: int = 0, run_dir=None
) -> dict:
    model = tp4_model()
    model = dataclasses.replace(model, n_kv_heads=kv) if kv else model
    cfg = lora_job(model, lora_settings(base_dtype=base_dtype))
    cfg.parallel.tp, cfg.parallel.dp_shard = tp, dp
    cfg.parallel.compile = compile
    mesh = build_mesh("cpu", RunLayout.build(cfg, dp * tp))
    trainer = Trainer(cfg, mesh)
    per_rank = cfg.train.global_batch // mesh.dp
    lo = mesh.dp_rank * per_rank
    grads = {}

    def keep_grads(_opt, _args, _kwargs):  # every rank gathers, the last step's stay
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:
                grads[name] = full(p.grad)

    hook = trainer.optimizer.register_step_pre_hook(keep_grads)
    trainable = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    losses = []
    for inputs, labels in global_batches(cfg):
        losses.append(
            trainer.train_step([(inputs[lo : lo + per_rank], labels[lo : lo + per_rank])]).loss
        )
    hook.remove()
    params = {n: full(p) for n, p in trainer.model.named_parameters()}
    if run_dir is not None:  # the adapters' training checkpoint, for the test to export
        ckpt = Checkpointer(cfg, run_dir, trainer.checkpoint_states())
        ckpt.save(trainer.step)
        ckpt.close()
    inputs, labels = inputs[lo : lo + per_rank], labels[lo : lo + per_rank]
    comm = comm_full = None
    if not compile:  # the eager run of the same mesh counts them
        comm = one_step_collectives(trainer, inputs, labels)
    if not compile and not kv:  # (the test compares full fine-tuning's on tp4_model only)
        full_ft = Trainer(dataclasses.replace(cfg, lora=LoraConfig(rank=0)), mesh)
        comm_full = one_step_collectives(full_ft, inputs, labels)
    return {
        "comm": comm,
        "comm_full": comm_full,
        "losses": losses,
        "grads": grads,
        "adapters": {n: p for n, p in params.items() if is_adapter(n)},
        "base": {n: p for n, p in params.items() if not is_adapter(n)},
        "trainable": trainable,
        "grad_names": sorted(grads),
    }


def main():
    out, *specs = sys.argv[1:]
    init_distributed("cpu", 120, "auto")
    results = {}
    for spec in specs:
        mesh, *flags = spec.split(":")
        dp, tp = map(int, mesh.split("x"))
        base_dtype = "bf16" if "bf16" in flags else "fp32"
        kv = 2 if "kv2" in flags else 0
        run_dir = f"{out}.{spec.replace(':', '-')}" if kv else None  # a checkpoint to export
        results[spec] = train_on(dp, tp, base_dtype, "compile" in flags, kv, run_dir)
    if dist.get_rank() == 0:
        torch.save(results, out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
