"""One measured run for tools/bench.py: hybrid2d, transformers-native, or one process.

Launched by bench.py (torchrun for the distributed kinds). Every kind trains the same model
(loaded from the same HF directory or initialised identically) on the same global batches with
AdamW and grad clipping, and rank 0 writes step times, losses and peak RSS per rank as JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid2d.cli import OneLineParser, apply_overrides
from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import shutdown_distributed
from hybrid2d.metrics import peak_memory_bytes


def batches(model: ModelConfig, global_batch: int, seq_len: int, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        t = torch.randint(0, model.vocab_size, (global_batch, seq_len + 1), generator=gen)
        yield t[:, :-1], t[:, 1:]


def bench_job(model: ModelConfig, global_batch, seq_len, steps, dp, tp, device, settings):
    """The hybrid2d job every bench run trains (bench.py validates it before launching)."""
    cfg = JobConfig(recipe="bench", model=model)
    t = cfg.train
    t.global_batch, t.seq_len, t.steps, t.seed = global_batch, seq_len, steps, 0
    t.lr, t.warmup_steps, t.grad_clip, t.device = 1e-3, 0, 1.0, device
    cfg.parallel.tp, cfg.parallel.dp_shard = tp, dp
    apply_overrides(cfg, ["--" + item for item in settings or []])
    return cfg


def job_config(args) -> JobConfig:
    with open(os.path.join(args.model_dir, "hybrid2d_model.json")) as f:
        model = ModelConfig(**json.load(f))
    return bench_job(
        model, args.global_batch, args.seq_len, args.steps, args.dp, args.tp, args.device, args.set
    )


def weight_checksums(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of every parameter's full (unsharded) fp32 values, by name, taken after loading
    and before the first step; sharded parameters are gathered one at a time. Filled on rank 0
    (empty elsewhere); bench.py compares the kinds' checksums."""
    out = {}
    main = not dist.is_initialized() or dist.get_rank() == 0
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if main:
            data = full.detach().to("cpu", torch.float32).contiguous().view(torch.uint8)
            key = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            out[key] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        del full
    return out


def synchronize(device: torch.device) -> None:
    """Step times on CUDA must include the queued kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_precision(device: torch.device):
    """transformers and the single process on CUDA: bf16 matmuls over fp32 weights, as hybrid2d's
    default mixed precision there (bf16 parameters for compute, fp32 master weights and
    gradient reduction); CPU runs are fp32 throughout, as hybrid2d's."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# run_hybrid2d's (wall, CPU) seconds in the balance monitor, step by step; the wall time
# includes waiting in its all-gather for the slowest rank, which the next collective would wait
# for otherwise, the CPU time is the work it adds.
MONITOR_S: list[tuple[float, float]] = []


def run_hybrid2d(args):
    from hybrid2d.mesh import build_mesh, init_distributed
    from hybrid2d.metrics import MetricsWriter
    from hybrid2d.metrics.balance import BalanceMonitor
    from hybrid2d.trainer import Trainer

    cfg = job_config(args)
    layout = RunLayout.build(
        cfg, dist.get_world_size() if dist.is_initialized() else args.dp * args.tp
    )
    init_distributed(args.device, 300, cfg.parallel.shm_collectives)
    mesh = build_mesh(args.device, layout)
    trainer = Trainer(cfg, mesh)
    # The trainer loop's step breakdown and its gather on logged steps (metrics.balance; the
    # bench's runs log every step), timed with the step: `--lever metrics.balance=false` is
    # its cost.
    clock = trainer.clock
    balance = BalanceMonitor(cfg, mesh, clock, MetricsWriter(None, False), None)
    checksums = weight_checksums(trainer.model)
    per, mb = layout.local_batch, layout.micro_batch
    lo = mesh.dp_rank * per
    times, losses = [], []
    monitor = MONITOR_S
    comm = None
    for step, (x, y) in enumerate(batches(cfg.model, args.global_batch, args.seq_len, args.steps)):
        micro = [(x[i : i + mb], y[i : i + mb]) for i in range(lo, lo + per, mb)]
        start = time.perf_counter()
        clock.begin_step()
        if args.comm and step == args.steps - 1:
            from hybrid2d.comm_report import CollectiveCounter

            with CollectiveCounter() as counter:
                r = trainer.train_step(micro)
            comm = counter.summary()
        else:
            r = trainer.train_step(micro)
        clock.end_step()
        logged, cpu = time.perf_counter(), time.process_time()
        balance.after_step(r.step)
        done = time.perf_counter()
        times.append(done - start)
        losses.append(r.loss)
        monitor.append((done - logged, time.process_time() - cpu))
    tensor_peak = None
    if args.tensor_peak:  # one more step, untimed, with every tensor tracked (CPU's figure)
        from hybrid2d.profiling.measure import measure_step

        with measure_step(trainer.model, trainer.optimizer, args.steps) as memory:
            trainer.train_step(micro)
        tensor_peak = memory[0].peak
    return times, losses, comm, mesh.device, checksums, tensor_peak


def run_transformers(args):
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    from hybrid2d.optim import clip_grad_norm

    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir,
        distributed_config=DistributedConfig(tp_size=args.tp, fsdp_size=args.dp),
        dtype=torch.float32,
    )
    model.train()
    checksums = weight_checksums(model)
    mesh = model._device_mesh
    dp_rank = mesh["fsdp"].get_local_rank() if args.dp > 1 else 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    cfg = job_config(args)
    per = args.global_batch // args.dp
    lo = dp_rank * per
    times, losses = [], []
    for x, y in batches(cfg.model, args.global_batch, args.seq_len, args.steps):
        synchronize(device)
        start = time.perf_counter()
        x, y = x[lo : lo + per].to(device), y[lo : lo + per].to(device)
        with compute_precision(device):
            logits = model(input_ids=x).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        # torch's clip_grad_norm_ refuses grads on different meshes (norms are on the fsdp mesh
        # only, projections on fsdp x tp); hybrid2d's handles any mix with one all-reduce.
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())  # .item() waits for the step
        times.append(time.perf_counter() - start)
    return times, losses, None, device, checksums


def run_single(args):
    from hybrid2d.models.llama import Llama

    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    cfg = job_config(args)
    model = Llama(cfg.model)
    model.init_weights(0)
    model.to(device)
    checksums = weight_checksums(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times, losses = [], []
    for x, y in batches(cfg.model, args.global_batch, args.seq_len, args.steps):
        synchronize(device)
        start = time.perf_counter()
        x, y = x.to(device), y.to(device)
        with compute_precision(device):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # .item() waits for the step
        times.append(time.perf_counter() - start)
    return times, losses, None, device, checksums


def main():
    p = OneLineParser()
    p.add_argument("--impl", choices=["hybrid2d", "transformers", "single"], required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--comm", action="store_true")
    p.add_argument(
        "--tensor-peak", action="store_true", help="hybrid2d: also one tracked step's tensor peak"
    )
    p.add_argument("--set", action="append", help="hybrid2d setting section.field=value")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if "RANK" in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    run = {"hybrid2d": run_hybrid2d, "transformers": run_transformers, "single": run_single}
    times, losses, comm, device, checksums, *tensor_peak = run[args.impl](args)
    peaks = [peak_memory_bytes(device)]  # CUDA: peak allocated by tensors; CPU: peak RSS
    tensor_peaks = [tensor_peak[0] if tensor_peak else None]
    if dist.is_initialized():
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_memory_bytes(device))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tensor_peaks[0])
        tensor_peaks = gathered
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "times": times,
                    "losses": losses,
                    "peak_mem": peaks,
                    "tensor_peak": tensor_peaks,
                    "comm": comm,
                    "checksums": checksums,
                    "monitor_s": MONITOR_S,
                },
                f,
            )
    shutdown_distributed()


if __name__ == "__main__":
    main()
