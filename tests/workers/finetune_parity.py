"""Worker: train the tiny model on instruction-like global batches (labels -100 off the loss,
uneven loss tokens per sample) on a (dp, tp) mesh, with SGD + clipping and then AdamW, and
measure the validation loss on a held-out set; rank 0 saves the results.

usage: finetune_parity.py OUT DP TP MICRO_BATCH
"""

import sys

import torch
import torch.distributed as dist

from hybrid2d.config import JobConfig
from hybrid2d.data import EvalSet
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from tests.reference import masked_global_batches, tiny_config

VAL_SAMPLES = 11  # not a multiple of dp x micro batch: the held-out set is padded


class Tensors:
    def __init__(self, inputs, labels):
        self.inputs, self.labels = inputs, labels

    def __len__(self):
        return len(self.inputs)

    def gather(self, idx):
        idx = torch.as_tensor(idx, dtype=torch.long)
        return self.inputs[idx], self.labels[idx]


def val_set(cfg: JobConfig):
    inputs, labels = zip(*masked_global_batches(cfg, seed=99, steps=2), strict=True)
    return torch.cat(inputs)[:VAL_SAMPLES], torch.cat(labels)[:VAL_SAMPLES]


def main():
    out, dp, tp, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    init_distributed("cpu", 120)
    from hybrid2d.trainer import Trainer

    mesh = None
    results = {}
    for optimizer, clip in (("sgd", 0.5), ("adamw", 1.0)):
        cfg = tiny_config(optimizer, clip)
        cfg.train.micro_batch = micro
        cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
        layout = RunLayout.build(cfg, dist.get_world_size())
        mesh = build_mesh("cpu", layout) if mesh is None else mesh.with_layout(layout)
        trainer = Trainer(cfg, mesh)
        per_rank = cfg.train.global_batch // mesh.dp
        losses, norms = [], []
        for inputs, labels in masked_global_batches(cfg):
            lo = mesh.dp_rank * per_rank
            batches = [
                (inputs[i : i + micro], labels[i : i + micro])
                for i in range(lo, lo + per_rank, micro)
            ]
            r = trainer.train_step(batches)
            losses.append(r.loss)
            norms.append(r.grad_norm)
        val_loss, val_ppl = trainer.evaluate(EvalSet(Tensors(*val_set(cfg)), "test"))
        params = {}
        for name, p in trainer.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[name] = full.detach().clone()
        results[optimizer] = {
            "losses": losses,
            "norms": norms,
            "params": params,
            "val_loss": val_loss,
            "val_ppl": val_ppl,
        }
        del trainer
    if dist.get_rank() == 0:
        torch.save(results, out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
