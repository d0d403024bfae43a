"""CollectiveCounter on one process: it files a process group's collective by c10d's op name in
whatever namespace a backend gives it, without being told which backends exist."""

import torch

from hybrid2d.comm_report import CollectiveCounter

# A backend of this test's own, showing its calls to dispatch modes as the shared-memory backend
# does: ops named after c10d's, taking c10d's (output, input, ...) arguments.
_lib = torch.library.Library("hybrid2d_test_backend", "DEF")
for _name in ("_allgather_base_", "_reduce_scatter_base_", "allreduce_"):
    _lib.define(f"{_name}(Tensor(a!) output, Tensor input) -> bool")
    _lib.impl(_name, lambda output, input: True, "CPU")
OPS = torch.ops.hybrid2d_test_backend


def test_a_backends_own_collective_ops_are_counted_as_c10d_s():
    gathered, shard = torch.zeros(8, 4), torch.zeros(2, 4)
    with CollectiveCounter() as counter:
        OPS._allgather_base_(gathered, shard)
        OPS._reduce_scatter_base_(shard, gathered)
        OPS._reduce_scatter_base_(shard, gathered)
        OPS.allreduce_(shard, shard)
        torch.add(shard, 1)
    summary = counter.summary()
    assert summary["counts"] == {
        "fsdp_all_gather": 1,
        "fsdp_reduce_scatter": 2,
        "scalar_all_reduce": 1,
    }
    # payload: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor (fp32)
    assert summary["bytes"] == {
        "fsdp_all_gather": 32 * 4,
        "fsdp_reduce_scatter": 2 * 32 * 4,
        "scalar_all_reduce": 8 * 4,
    }
    assert summary["by_op"] == {
        "hybrid2d_test_backend._allgather_base_": 1,
        "hybrid2d_test_backend._reduce_scatter_base_": 2,
        "hybrid2d_test_backend.allreduce_": 1,
    }
