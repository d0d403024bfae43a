"""One measured run for tools/bench.py: hybrid2d, transformers-native, or one process.

Launched by bench.py (torchrun for the distributed kinds). Every kind trains the same model
(loaded from the same HF directory or initialised identically) on the same global batches with
AdamW and grad clipping, and rank 0 writes step times, losses and peak RSS per rank as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid2d.config import JobConfig, ModelConfig, apply_overrides  # noqa: E402
from hybrid2d.mesh import shutdown_distributed  # noqa: E402
from hybrid2d.metrics import peak_rss_bytes  # noqa: E402


def batches(model: ModelConfig, global_batch: int, seq_len: int, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        t = torch.randint(0, model.vocab_size, (global_batch, seq_len + 1), generator=gen)
        yield t[:, :-1], t[:, 1:]


def job_config(args) -> JobConfig:
    with open(os.path.join(args.model_dir, "hybrid2d_model.json")) as f:
        model = ModelConfig(**json.load(f))
    cfg = JobConfig(recipe="bench", model=model)
    t = cfg.train
    t.global_batch, t.seq_len, t.steps, t.seed = args.global_batch, args.seq_len, args.steps, 0
    t.lr, t.warmup_steps, t.grad_clip = 1e-3, 0, 1.0
    cfg.parallel.tp, cfg.parallel.dp_shard = args.tp, args.dp
    apply_overrides(cfg, ["--" + item for item in args.set or []])
    return cfg


def run_hybrid2d(args):
    from hybrid2d.mesh import build_mesh, init_distributed
    from hybrid2d.trainer import Trainer

    cfg = job_config(args)
    cfg.validate(dist.get_world_size() if dist.is_initialized() else args.dp * args.tp)
    init_distributed("cpu", 300)
    mesh = build_mesh("cpu", 1, args.dp, args.tp)
    trainer = Trainer(cfg, mesh)
    per = args.global_batch // mesh.dp
    lo = mesh.dp_rank * per
    mb = cfg.train.micro_batch or per
    times, losses = [], []
    comm = None
    for step, (x, y) in enumerate(batches(cfg.model, args.global_batch, args.seq_len, args.steps)):
        micro = [(x[i : i + mb], y[i : i + mb]) for i in range(lo, lo + per, mb)]
        if args.comm and step == args.steps - 1:
            from hybrid2d.comm_report import CollectiveCounter

            with CollectiveCounter() as counter:
                r = trainer.train_step(micro)
            comm = counter.summary()
        else:
            r = trainer.train_step(micro)
        times.append(r.seconds)
        losses.append(r.loss)
    return times, losses, comm


def run_transformers(args):
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    from hybrid2d.optim import clip_grad_norm

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir,
        distributed_config=DistributedConfig(tp_size=args.tp, fsdp_size=args.dp),
        dtype=torch.float32,
    )
    model.train()
    mesh = model._device_mesh
    dp_rank = mesh["fsdp"].get_local_rank() if args.dp > 1 else 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    cfg = job_config(args)
    per = args.global_batch // args.dp
    lo = dp_rank * per
    times, losses = [], []
    for x, y in batches(cfg.model, args.global_batch, args.seq_len, args.steps):
        start = time.perf_counter()
        logits = model(input_ids=x[lo : lo + per]).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y[lo : lo + per].flatten())
        loss.backward()
        # torch's clip_grad_norm_ refuses grads on different meshes (norms are on the fsdp mesh
        # only, projections on fsdp x tp); hybrid2d's handles any mix with one all-reduce.
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        times.append(time.perf_counter() - start)
        losses.append(value.item() / dist.get_world_size())
    return times, losses, None


def run_single(args):
    from hybrid2d.models.llama import Llama

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = job_config(args)
    model = Llama(cfg.model)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times, losses = [], []
    for x, y in batches(cfg.model, args.global_batch, args.seq_len, args.steps):
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hybrid2d", "transformers", "single"], required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--comm", action="store_true")
    p.add_argument("--set", action="append", help="hybrid2d setting section.field=value")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if "RANK" in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    run = {"hybrid2d": run_hybrid2d, "transformers": run_transformers, "single": run_single}
    times, losses, comm = run[args.impl](args)
    peaks = [peak_rss_bytes()]
    if dist.is_initialized():
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_rss_bytes())
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "losses": losses, "peak_rss": peaks, "comm": comm}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
