"""Worker: on one 4-rank launch, train the tiny model on instruction samples packed into rows
(document masks) and on the same samples padded one per row, on the (2,2), (1,4) and (4,1)
meshes with micro batch 1 and 2 (SGD + clipping); record the first step's gradients, every
step's loss and grad norm, the final parameters and the validation loss of both layouts; and
LoRA on packed rows on (2,2). Rank 0 saves them for tests/test_packing_parity.py.

usage: packing_parity.py OUT
"""

import copy
import sys

import numpy as np
import torch
import torch.distributed as dist

from hybrid2d.config import LoraConfig
from hybrid2d.data.batch import Batch
from hybrid2d.data.instruct import IGNORE_INDEX, InstructionDataset, InstructStats
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.run_data import EvalSet, PackedRows
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.parallel.lora import adapter_state, sum_replicated_grads
from tests.reference import tiny_config

MESHES = [(2, 2), (1, 4), (4, 1)]
STEPS = 2
SEQ_LEN = 32
DATA_SEED = 5
LORA = LoraConfig(rank=3, alpha=6.0, targets="all-linear")


def packing_config():
    cfg = tiny_config("sgd", 0.5, steps=STEPS)
    cfg.train.seq_len = SEQ_LEN
    return cfg


def synthetic_samples(n: int, seed: int, seq_len: int = SEQ_LEN, vocab: int = 256):
    """n instruction samples of 3..seq_len + 1 tokens (mostly short, a few filling a row), a
    prompt without loss and a completion of one to many loss tokens each."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(3 + rng.geometric(0.08, n), seq_len + 1)
    tokens, targets = [], []
    for length in lengths:
        prompt = int(rng.integers(1, length - 1))
        tokens.append(rng.integers(1, vocab, length))
        targets.append(np.arange(length) >= prompt)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    loss = np.array([int(t[1:].sum()) for t in targets], dtype=np.int32)
    return InstructionDataset(
        np.concatenate(tokens).astype(np.int32),
        np.concatenate(targets),
        offsets,
        seq_len,
        0,
        InstructStats(),
        loss,
        np.zeros(n, dtype=bool),
    )


def step_samples(ds, cfg, steps=STEPS) -> list[np.ndarray]:
    """The samples of each packed step (the global rows' samples, as the loader packs them)."""
    one = RunLayout.build(cfg, 1, dp_replicate=1, dp_shard=1, tp=1, micro_batch=1)
    loader = GlobalBatchLoader(ds, one, 0, cfg.train.seed, packed=True)
    out = []
    for _ in range(steps):
        rows, k = loader.step_rows(loader.samples_consumed)
        loader.samples_consumed += k
        out.append(np.concatenate(rows))
    return out


def padded_batches(ds, samples, mesh) -> list[Batch]:
    """This rank's micro batches of the samples padded one per row, with rows holding no token
    added up to a multiple of dp x micro batch."""
    dp, micro = mesh.dp, mesh.layout.micro_batch
    batch = ds.gather(samples)
    extra = -len(samples) % (dp * micro)
    if extra:
        inputs = torch.cat([batch.inputs, torch.zeros(extra, SEQ_LEN, dtype=torch.long)])
        labels = torch.cat([batch.labels, torch.full((extra, SEQ_LEN), IGNORE_INDEX)])
        real = torch.cat([batch.real_tokens, torch.zeros(extra, dtype=torch.long)])
        batch = Batch(inputs, labels, None, real)
    per_rank = len(batch.inputs) // dp
    lo = mesh.dp_rank * per_rank
    return [batch.rows(i, i + micro) for i in range(lo, lo + per_rank, micro)]


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole, whether a DTensor (sharded) or a plain tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def first_grads(trainer, batches) -> dict:
    """The gradients of the step's loss (summed token loss / global loss tokens) at the
    current weights, as the trainer computes them, gathered whole (LoRA: the adapters', once
    summed over tp as train_step sums them)."""
    total, *_ = trainer.global_counts(batches)
    for b in batches:
        trainer.forward_backward(
            b.inputs, b.labels, float(trainer.mesh.dp), float(total), b.documents
        )
    sum_replicated_grads(trainer.replicated_adapters, trainer.mesh.tp_mesh)
    named = trainer.model.named_parameters()
    grads = {n: whole(p.grad) for n, p in named if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def packed_lora(cfg, ds) -> dict:
    """LoRA (LORA's adapters on a frozen base) on packed rows with document masks, (2, 2),
    micro batch 2: the first step's adapter gradients, each step's loss and grad norm, the final
    adapters."""
    from hybrid2d.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    cfg.lora = LORA
    cfg.parallel.dp_shard, cfg.parallel.tp, cfg.train.micro_batch = 2, 2, 2
    layout = RunLayout.build(cfg, dist.get_world_size())
    mesh = build_mesh("cpu", layout)
    trainer = Trainer(cfg, mesh)
    loader = GlobalBatchLoader(ds, layout, mesh.dp_rank, cfg.train.seed, packed=True)
    got = {"losses": [], "norms": []}
    for step in range(STEPS):
        batches = loader.next_batch()
        if step == 0:
            got["grads"] = first_grads(trainer, batches)
        r = trainer.train_step(batches)
        got["losses"].append(r.loss)
        got["norms"].append(r.grad_norm)
    got["params"] = {n: whole(p) for n, p in adapter_state(trainer.model).items()}
    return got


def main():
    out = sys.argv[1]
    init_distributed("cpu", 120)
    from hybrid2d.trainer import Trainer

    cfg = packing_config()
    ds, val_ds = synthetic_samples(200, DATA_SEED), synthetic_samples(11, DATA_SEED + 1)
    results = {}
    for dp, tp in MESHES:
        cfg.parallel.dp_shard, cfg.parallel.tp = dp, tp
        mesh = None
        for micro in (1, 2):
            cfg.train.micro_batch = micro
            layout = RunLayout.build(cfg, dist.get_world_size())
            mesh = build_mesh("cpu", layout) if mesh is None else mesh.with_layout(layout)
            for mode in ("packed", "padded"):
                trainer = Trainer(cfg, mesh)
                loader = GlobalBatchLoader(ds, layout, mesh.dp_rank, cfg.train.seed, packed=True)
                got = {"losses": [], "norms": [], "samples": []}
                for step in range(STEPS):
                    if mode == "packed":
                        start = loader.samples_consumed
                        batches = loader.next_batch()
                        got["samples"].append(loader.samples_consumed - start)
                    else:
                        samples = step_samples(ds, cfg)[step]
                        batches = padded_batches(ds, samples, mesh)
                        got["samples"].append(len(samples))
                    if step == 0:
                        got["grads"] = first_grads(trainer, batches)
                    r = trainer.train_step(batches)
                    got["losses"].append(r.loss)
                    got["norms"].append(r.grad_norm)
                val = EvalSet(PackedRows(val_ds) if mode == "packed" else val_ds, "test")
                got["val_loss"] = trainer.evaluate(val)[0]
                got["params"] = {n: whole(p) for n, p in trainer.model.named_parameters()}
                results[(dp, tp, micro, mode)] = got
                del trainer
    results["lora"] = packed_lora(cfg, ds)
    if dist.get_rank() == 0:
        torch.save(results, out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
