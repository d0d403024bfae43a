"""Worker: a non-finite step in the middle of training on a (dp, tp) mesh, then what it left.

usage: paths_nonfinite.py OUT DP TP WHAT MODE
  WHAT: "grad" (one gradient element set to inf on the last rank only, before the global norm:
        the loss stays finite, the norm does not) or "loss" (the loss reported as inf)
  MODE: the train.on_nonfinite setting, skip or stop

Steps 1-2 train normally (AdamW, so there is optimizer state), step 3 is the bad one, step 4
trains again. Rank 0 writes {"results", "changed", "state_changed", "error"} to OUT, where
changed / state_changed list the parameters / optimizer state entries on any rank whose local
tensors differ bit for bit from their copy taken before step 3.
"""

import json
import sys

import torch
import torch.distributed as dist

import hybrid2d.trainer as trainer_module
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.trainer import NonFiniteError, Trainer
from tests.reference import global_batches, tiny_config

BAD_STEP = 3


def local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(trainer):
    params = {n: local(p) for n, p in trainer.model.named_parameters()}
    state = {}
    for p_name, p in trainer.model.named_parameters():
        for k, v in trainer.optimizer.state.get(p, {}).items():
            state[f"{p_name}.{k}"] = local(v) if isinstance(v, torch.Tensor) else v
    return params, state


def differs(before: dict, after: dict) -> list[str]:
    out = []
    for k, v in before.items():
        w = after.get(k)
        same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
        if not same:
            out.append(k)
    return out


def main():
    out, dp, tp, what, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
    cfg = tiny_config("adamw", 1.0, steps=4)
    cfg.parallel.tp, cfg.parallel.dp_shard = tp, dp
    cfg.train.on_nonfinite = mode
    layout = RunLayout.build(cfg, dp * tp)
    init_distributed("cpu", 120)
    mesh = build_mesh("cpu", layout)
    trainer = Trainer(cfg, mesh)
    rank, world = dist.get_rank(), dist.get_world_size()

    clip = trainer_module.clip_grad_norm

    def clip_with_an_inf(params, max_norm):
        params = list(params)
        if what == "grad" and trainer.step + 1 == BAD_STEP and rank == world - 1:
            g = next(p.grad for p in params if p.grad is not None)
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
        return clip(params, max_norm)

    trainer_module.clip_grad_norm = clip_with_an_inf
    forward_backward = trainer.forward_backward

    def loss_inf(*args, **kwargs):
        loss = forward_backward(*args, **kwargs)
        if what == "loss" and trainer.step + 1 == BAD_STEP:
            return loss * float("inf")
        return loss

    trainer.forward_backward = loss_inf

    per = cfg.train.global_batch // mesh.dp
    lo = mesh.dp_rank * per
    results, error, before, after = [], None, None, None
    for step, (x, y) in enumerate(global_batches(cfg), start=1):
        if step == BAD_STEP:
            before = snapshot(trainer)
        try:
            r = trainer.train_step([(x[lo : lo + per], y[lo : lo + per])])
        except NonFiniteError as e:
            error = str(e)
            after = snapshot(trainer)
            break
        results.append({"step": r.step, "loss": r.loss, "norm": r.grad_norm, "skip": r.skipped})
        if step == BAD_STEP:
            after = snapshot(trainer)
    changed = differs(before[0], after[0])
    state_changed = differs(before[1], after[1])
    gathered = [None] * world
    dist.all_gather_object(gathered, (changed, state_changed, error, results))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "results": [g[3] for g in gathered],
                    "changed": sorted({n for g in gathered for n in g[0]}),
                    "state_changed": sorted({n for g in gathered for n in g[1]}),
                    "errors": [g[2] for g in gathered],
                    "state_entries": len(before[1]),
                },
                f,
            )
    shutdown_distributed()


if __name__ == "__main__":
    main()
