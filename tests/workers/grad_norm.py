"""Worker: the global gradient norm of a TP x FSDP2 model, hand loop against torch's helpers.

usage: grad_norm.py OUT DP TP REPEATS [DP_REPLICATE [MODEL]]   (MODEL: tiny | llama-debug)

Builds the tiny test model on a (dp_replicate, dp_shard, tp) mesh, runs one forward/backward,
then on the same DTensor gradients: the norm of `optim.clip_grad_norm` (one all-reduce over the
world, replicated shards weighted), of `torch_clip_grad_norm` below (torch.nn.utils
get_total_norm + clip_grads_with_norm_) and of the gathered full gradients (float64). Counts the
collectives each issues (CommDebugMode) and times them, alternating, REPEATS calls each. Rank 0
writes JSON to OUT.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from hybrid2d import recipes
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.optim import clip_grad_norm
from tests.reference import global_batches, tiny_config


@torch.no_grad()
def torch_clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm through torch.nn.utils.get_total_norm / clip_grads_with_norm_ (as
    torchtitan does): DTensor reduces each norm over the mesh dims its gradient is sharded on.
    The reference optim.clip_grad_norm is measured and tested against."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


KINDS = {"hybrid2d": clip_grad_norm, "torch": torch_clip_grad_norm}


def main():
    out, dp, tp, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dp_rep = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    cfg = tiny_config(optimizer="sgd", grad_clip=1.0)
    if len(sys.argv) > 6 and sys.argv[6] == "llama-debug":
        cfg.model = recipes.get("llama-debug").model
    cfg.parallel.tp, cfg.parallel.dp_replicate, cfg.parallel.dp_shard = tp, dp_rep, dp // dp_rep
    cfg.parallel.shm_collectives = "off"  # plain gloo: what is counted is what crosses ranks
    layout = RunLayout.build(cfg, dp * tp)
    init_distributed("cpu", 120, cfg.parallel.shm_collectives)
    from hybrid2d.trainer import Trainer

    mesh = build_mesh("cpu", layout)
    trainer = Trainer(cfg, mesh)
    inputs, labels = next(iter(global_batches(cfg)))
    per_rank = cfg.train.global_batch // mesh.dp
    lo = mesh.dp_rank * per_rank
    trainer.forward_backward(inputs[lo : lo + per_rank], labels[lo : lo + per_rank], 1.0)
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    placements = sorted(
        {str(tuple(p.grad.placements)) for p in params if isinstance(p.grad, DTensor)}
    )

    full = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        full += g.double().pow(2).sum()
    reference = full.sqrt().item()

    result = {"reference": reference, "placements": placements, "world": dist.get_world_size()}
    for name, fn in KINDS.items():
        with CommDebugMode() as comm:
            norm = fn(params, 1e9).item()  # coefficient 1: gradients unchanged
        result[name] = {
            "norm": norm,
            "rel_err": abs(norm - reference) / reference,
            "collectives": comm.get_total_counts(),
            "by_op": {str(k): v for k, v in comm.get_comm_counts().items()},
            "times": [],
        }
    for _ in range(repeats):
        for name, fn in KINDS.items():
            dist.barrier()
            start = time.perf_counter()
            fn(params, 1e9)
            result[name]["times"].append(time.perf_counter() - start)
    # Clipping for real: the same coefficient on every gradient as the reference norm says.
    before = [
        p.grad.full_tensor().clone() if isinstance(p.grad, DTensor) else p.grad.clone()
        for p in params
    ]
    clipped = clip_grad_norm(params, reference / 2)
    after = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    coef = (reference / 2) / (clipped.item() + 1e-6)
    result["clip_max_err"] = max(
        (a - b * coef).abs().max().item() / max(b.abs().max().item(), 1e-30)
        for a, b in zip(after, before, strict=True)
    )
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, {k: result[k]["times"] for k in KINDS})
    for name in KINDS:  # a call takes as long as its slowest rank
        per_call = [max(t[name][i] for t in times) for i in range(repeats)]
        result[name]["median_ms"] = sorted(per_call)[repeats // 2] * 1e3
        del result[name]["times"]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    shutdown_distributed()


if __name__ == "__main__":
    main()
