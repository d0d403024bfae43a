"""Worker: one llama-debug block, tensor-parallel over all ranks and under torch.compile, run
forward once under saved-tensor hooks; rank 0 writes the bytes per token that autograd keeps
for backward (parameters, the rope tables and checkpointing's RNG state excluded) to OUT as
{"AC:DTYPE": bytes per token}, one entry per spec.

usage: compiled_saved.py OUT AC:DTYPE [AC:DTYPE ...]   (DTYPE fp32 or bf16)

Each spec compiles its block after torch.compiler.reset(), as a fresh process would; the
launch pays for starting its ranks and for inductor's first use once, not once per spec.
"""

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybrid2d import recipes
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import build_mesh, init_distributed, shutdown_distributed
from hybrid2d.models.llama import Llama
from hybrid2d.parallel.activation_checkpoint import apply_ac
from hybrid2d.parallel.tensor_parallel import apply_tp

BATCH, SEQ = 2, 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main():
    out, specs = sys.argv[1], sys.argv[2:]
    init_distributed("cpu", 300)
    tp = dist.get_world_size()
    cfg = recipes.get("llama-debug")
    mesh = build_mesh("cpu", RunLayout.build(cfg, tp, dp_shard=1, tp=tp))
    result = {}
    for spec in specs:
        ac, dtype = spec.split(":")
        torch.compiler.reset()  # a cold compile of this spec's block, as in a fresh process
        result[spec] = bytes_per_token(cfg.model, mesh, tp, ac, DTYPES[dtype])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    shutdown_distributed()


def bytes_per_token(m, mesh, tp: int, ac: str, dtype: torch.dtype) -> float:
    """What autograd keeps per token for one compiled block of model shape `m` (see above)."""
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(m, n_layers=1)).to(dtype)
    apply_tp(model, mesh.tp_mesh)
    apply_ac(model, ac)
    block = model.model.layers[0]
    block.compile()
    cos, sin = model.rope(SEQ, dtype)
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    skip = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    x = torch.randn(BATCH, SEQ // tp, m.dim, dtype=dtype, requires_grad=True)  # sequence-sharded
    kept: dict[int, int] = {}

    rng_state = torch.get_rng_state()  # checkpointing keeps one per block: 5 KiB, not per token

    def pack(t):
        storage = local(t).untyped_storage()
        if t.dtype == torch.uint8 and t.shape == rng_state.shape:
            return t
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    # Both calls under the hooks, so that the second runs the graph the first compiled.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(2):
            kept.clear()
            block(x, cos, sin).float().sum().backward()
    if dist.get_rank() == 0 and os.environ.get("SHOW_SAVED"):
        print(kept)
    return sum(kept.values()) / (BATCH * SEQ)


if __name__ == "__main__":
    main()
