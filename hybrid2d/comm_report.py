"""Collectives of one training step, measured: counted with torch's CommDebugMode, sized, and
compared with the planner's prediction (`planner.comm.analytic_step`, whose kinds and payload
convention these are: the full buffer of each collective).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor.debug import CommDebugMode

# c10d's name of each collective (CommDebugMode's op name without its namespace for the process
# group's ops) -> the kind the report files it under.
_KIND = {
    "c10d_functional.all_gather_into_tensor": "tp_all_gather",
    "c10d_functional.reduce_scatter_tensor": "tp_reduce_scatter",
    "c10d_functional.all_reduce": "tp_all_reduce",
    "_allgather_base_": "fsdp_all_gather",
    "allgather_into_tensor_coalesced_": "fsdp_all_gather",
    "_reduce_scatter_base_": "fsdp_reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "fsdp_reduce_scatter",
    "allreduce_": "scalar_all_reduce",
}


def _collective(func) -> str | None:
    """c10d's name (a `_KIND` key) of the collective a dispatcher op runs, or None. The functional
    collectives by their full name; a process group's by the op's own name in any namespace:
    gloo's are c10d's, and a backend that shows its calls to dispatch modes names them after
    c10d's ops with c10d's arguments (the shared-memory backend does), so counting needs no list
    of backends."""
    name = str(func.overloadpacket).lstrip("_")
    if name in _KIND:
        return name
    op = name.rsplit(".", 1)[-1]
    return op if op in _KIND else None


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _payload(name: str, args) -> int:
    if name == "c10d_functional.all_gather_into_tensor":
        return _nbytes(args[0]) * int(args[1])  # (input shard, group_size, group)
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        return _nbytes(args[0])  # (output, input, ...)
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        return _nbytes(args[1])
    return _nbytes(args[0])


class CollectiveCounter(CommDebugMode):
    """CommDebugMode that also adds up each collective's payload bytes by kind."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __enter__(self):
        super().__enter__()
        # Count globally: CommDebugMode's per-module attribution fails when a step runs several
        # forwards (micro batches), so its module hooks are removed right away.
        self.advanced_module_tracker.__exit__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _collective(func)
        if name is not None:
            # CommDebugMode's own counts (`by_op`) then see a backend's ops as well.
            self.comm_registry.add(func.overloadpacket)
            kind = _KIND[name]
            self.counts[kind] += 1
            self.bytes[kind] += _payload(name, args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def summary(self) -> dict:
        return {
            "by_op": {str(k): v for k, v in self.get_comm_counts().items()},
            "counts": dict(self.counts),
            "bytes": dict(self.bytes),
        }


MINIMUM_KINDS = ("tp_all_gather", "tp_reduce_scatter", "fsdp_all_gather", "fsdp_reduce_scatter")


def format_comm(measured: dict, analytic: dict | None = None) -> str:
    analytic = analytic or {}
    lines = [
        "| collective | count | payload MiB | analytic count | analytic MiB |",
        "|---|---|---|---|---|",
    ]
    for k in sorted(set(measured["counts"]) | set(analytic)):
        c, b = measured["counts"].get(k, 0), measured["bytes"].get(k, 0)
        ac, ab = analytic.get(k, (0, 0))
        lines.append(f"| {k} | {c} | {b / 2**20:.3f} | {ac} | {ab / 2**20:.3f} |")
    if analytic:
        total = sum(measured["bytes"].values())
        minimum = sum(analytic.get(k, (0, 0))[1] for k in MINIMUM_KINDS)
        lines.append(
            f"\ntotal payload {total / 2**20:.3f} MiB = {total / minimum:.4f} x the "
            f"analytic minimum ({minimum / 2**20:.3f} MiB: activations + FSDP)"
        )
    return "\n".join(lines)
