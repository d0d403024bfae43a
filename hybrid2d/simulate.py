"""One rank of a large mesh, run on this machine: the real model and training step over a fake
process group, measuring that rank's memory.

`torch.distributed`'s "fake" backend (torch.testing._internal.distributed.fake_pg) accepts every
collective and does nothing, so a single process can be rank r of a world of 64: the model is
built on the meta device, parallelised for the full (dp_replicate, dp_shard, tp) mesh by the
same `Trainer`/`build_model` a real run uses, and `to_empty` materialises only rank r's shards.
Then real training steps run (forward, loss parallel, backward, clip, optimizer step) under the
`MemoryTracker`. Collectives return garbage, so the numbers computed are meaningless; the memory
is not, because every tensor the step allocates is allocated with its real shape and dtype.

Two shortcuts keep large models affordable without changing what is allocated:
- weights are filled with noise shard by shard (the real initialisation draws each full tensor);
- with `skip_compute` (the default) matrix multiplications and attention return uninitialised
  outputs of the shape and dtype the real kernel would produce (found by running the op on the
  meta device). Elementwise work still runs, so a step costs seconds instead of TFLOPs.

Run in its own process (`python -m hybrid2d.simulate OUT.json < SPEC.json`) so that one
simulation's process group, RSS and peak never mix with another's; `run_subprocess` does that.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import unittest.mock

import torch
from torch.distributed.tensor import DTensor

# Private module, no public home yet (torch 2.13): TorchDispatchMode is what FlopCounterMode and
# CommDebugMode are built on; move when torch exports it publicly.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from hybrid2d.config import JobConfig, resolve_mixed_precision
from hybrid2d.data.batch import Batch
from hybrid2d.layout import MESH_DIMS, RunLayout
from hybrid2d.mesh import build_mesh
from hybrid2d.metrics import peak_rss_bytes
from hybrid2d.models.llama import Llama
from hybrid2d.profiling.measure import measure_step
from hybrid2d.trainer import Trainer

aten = torch.ops.aten

# Ops whose cost is O(n^3)-like; their outputs are fresh tensors (no views, no out=).
HEAVY_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


class SimulationMode(TorchDispatchMode):
    """What a one-rank simulation changes in the ops it runs (never what they allocate): heavy
    ops skipped (see the module docstring), and a non-finite `.item()` reads 0, since the fake
    collectives leave garbage that the trainer's non-finite guard would stop the step on."""

    def __init__(self, skip_compute: bool = True):
        super().__init__()
        self.skip_compute = skip_compute

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            value = func(*args, **kwargs)
            return value if math.isfinite(value) else type(value)(0)
        if not (self.skip_compute and func in HEAVY_OPS):
            return func(*args, **kwargs)
        device = next(
            a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"
        )
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        meta_out = func(*meta_args, **meta_kwargs)
        return tree_map_only(
            torch.Tensor,
            lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device),
            meta_out,
        )


def _noise_init():
    """Make `Llama.init_weights` fill each local shard with noise, never a full tensor."""

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(torch.randn(local.shape, generator=gen, dtype=local.dtype) * 0.02)

    return unittest.mock.patch.object(Llama, "init_weights", init_weights)


def packed_rows(inputs: torch.Tensor, labels: torch.Tensor, per_row: int = 3) -> Batch:
    """Rows of `per_row` documents each (the last takes what the others leave), as a packed
    run's rows hold: the step builds each row's own mask and positions from them."""
    rows, seq = inputs.shape
    document = torch.arange(seq) * per_row // seq
    return Batch(inputs, labels, document.expand(rows, seq).contiguous())


def prepare_config(cfg: JobConfig, layout: RunLayout, target: str) -> tuple[JobConfig, RunLayout]:
    """The run's settings and layout as the target device would run them, checked like a real
    run's (a copy: the simulated run's own settings)."""
    cfg = copy.deepcopy(cfg)
    # Resolved for the target, not for this CPU.
    cfg.parallel.mixed_precision = resolve_mixed_precision(cfg.parallel.mixed_precision, target)
    cfg.parallel.compile = False  # eager: the memory model and the tracker assume it
    cfg.checkpoint.init_from = cfg.checkpoint.resume = ""
    cfg.train.device = "cpu"
    return cfg, layout.with_choices(cfg)


def simulate(
    cfg: JobConfig,
    layout: RunLayout,
    rank: int = 0,
    target: str = "cuda",
    skip_compute: bool = True,
    micro_batches: int = 2,
    documents: bool = False,
) -> dict:
    """Rank `rank` of the layout's mesh: a warm-up step, then a measured one.

    The measured step runs min(micro_batches, per-rank batch / micro batch) micro batches: memory
    in a step with gradient accumulation is that of the second micro batch onwards (gradients
    already exist), so two stand for any number. `documents`: rows packed with several
    documents (`planner.launch.packed_documents`), so the step builds their per-row masks and
    positions as a packed run's does (`packed_rows`).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    cfg, layout = prepare_config(cfg, layout, target)
    world = layout.world
    torch.set_flush_denormal(True)
    torch.manual_seed(cfg.train.seed)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        m = build_mesh("cpu", layout)
        with _noise_init():
            trainer = Trainer(cfg, m)
        t = cfg.train
        micro = layout.micro_batch
        n = min(micro_batches, layout.n_micro)
        gen = torch.Generator().manual_seed(rank)

        def batch(count: int, rows: int, seq: int, packed: bool = False):
            v = layout.model.vocab_size
            tokens = [torch.randint(0, v, (rows, seq + 1), generator=gen) for _ in range(count)]
            if packed:
                return [packed_rows(x[:, :-1], x[:, 1:]) for x in tokens]
            return [(x[:, :-1], x[:, 1:]) for x in tokens]

        built = time.perf_counter()
        with SimulationMode(skip_compute):
            # A first step on one tiny sequence: FSDP's lazy init and the optimizer state exist
            # from then on, as in a run's steady state.
            trainer.train_step(batch(1, 1, m.tp))
            step_start = time.perf_counter()
            with measure_step(trainer.model, trainer.optimizer, 2, rank) as res:
                trainer.train_step(batch(n, micro, t.seq_len, documents))
        done = time.perf_counter()
        record = res[0].to_dict()
    finally:
        dist.destroy_process_group()
    return {
        "mesh": dict(zip(MESH_DIMS, layout.mesh_shape, strict=True)),
        "rank": rank,
        "world_size": world,
        "target": target,
        "mixed_precision": cfg.parallel.mixed_precision,
        "micro_batch": micro,
        "micro_batches_run": n,
        "seq_len": t.seq_len,
        "documents": documents,
        "skip_compute": skip_compute,
        "memory": record,
        "build_s": built - start,
        "step_s": done - step_start,
        "wall_s": done - start,
        "rss_peak": peak_rss_bytes(),
        "config": layout.recorded(cfg),
    }


def run_subprocess(
    cfg: JobConfig,
    layout: RunLayout,
    rank: int = 0,
    target: str = "cuda",
    skip_compute: bool = True,
    timeout: float | None = None,
    documents: bool = False,
) -> dict:
    """`simulate` in a fresh Python process; returns its result (raises with its stderr)."""
    # The layout travels as the settings that ask for it (its values in the settings' places).
    spec = {"config": layout.recorded(cfg), "mesh": list(layout.mesh_shape)}
    spec |= {"rank": rank, "target": target, "documents": documents}
    spec["skip_compute"] = skip_compute
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # A launcher's rank variables (the caller may be a rank itself) are not the simulation's.
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        proc = subprocess.run(
            [sys.executable, "-m", "hybrid2d.simulate", out],
            input=json.dumps(spec),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"simulation of mesh {layout} rank {rank} failed ({proc.returncode}):\n"
                f"{proc.stderr[-4000:]}"
            )
        with open(out) as f:
            return json.load(f)


def main(argv: list[str]) -> int:
    """OUT.json: the result of `simulate` for the spec (run_subprocess's) read from stdin."""
    (out_path,) = argv
    spec = json.load(sys.stdin)
    cfg = JobConfig.from_dict(spec.pop("config"))
    result = simulate(cfg, RunLayout.on_mesh(cfg, tuple(spec.pop("mesh"))), **spec)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
