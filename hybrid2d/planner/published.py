"""Published GPU measurements of Llama 3 training with FSDP, to hold the planner's predictions
against (docs/planner.md). Each row says where it comes from and on what hardware it ran.

All rows are torchtitan's (PyTorch's reference trainer for the same FSDP2 + DTensor stack),
bf16 without Float8 and without torch.compile (the rows that used them are left out). torchtitan
trains Llama 3 at sequence length 8192; its MFU figures only agree with that length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

TORCHTITAN_2024_12 = (
    "torchtitan docs/performance.md (versions of 2024-12-23/26), "
    "https://github.com/pytorch/torchtitan/blob/eaea6f6a2fa940f03a10906be1df3489cf30af85/"
    "docs/performance.md"
)
TORCHTITAN_2024_A100 = (
    "torchtitan docs/performance.md (2024, 64 A100 80GB), "
    "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/"
    "docs/performance.md"
)
# torchtitan's H100s: "Grand Teton" hosts, 8 H100 each with 96 GB HBM2e at 2.4 TB/s, 500 W
# power limit (below the SXM's 700 W), 400 Gb/s RDMA per GPU.
GRAND_TETON = {"memory_bytes": 96 * 2**30, "memory_bandwidth": 2.4e12}


@dataclass(frozen=True)
class Published:
    label: str
    source: str
    recipe: str
    gpu: str  # preset the prediction uses
    hardware_changes: dict = field(default_factory=dict)  # where the published machine differs
    nodes: int = 1
    dp_shard: int = 8
    tp: int = 1
    local_batch: int = 1
    seq_len: int = 8192
    activation_checkpoint: str = "none"
    tokens_per_s_per_gpu: float = 0.0
    memory_gib: float | None = None
    notes: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


ROWS = [
    Published(
        label="Llama 3.1 8B, 8 H100, FSDP 8",
        source=TORCHTITAN_2024_12 + " Table 1 (FSDP, eager)",
        recipe="llama3.1-8b",
        gpu="h100",
        hardware_changes=GRAND_TETON,
        nodes=1,
        dp_shard=8,
        local_batch=2,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=5762,
        memory_gib=82.4,
        notes="H100 at 500 W with HBM2e (2.4 TB/s, 96 GB); torchtitan's selective AC is op-level "
        "(saves every other matmul output), ours saves all matmul outputs but o/down",
    ),
    Published(
        label="Llama 3.1 8B, 128 H100, FSDP 128",
        source=TORCHTITAN_2024_12 + " Table 3 (FSDP, eager)",
        recipe="llama3.1-8b",
        gpu="h100",
        hardware_changes=GRAND_TETON,
        nodes=16,
        dp_shard=128,
        local_batch=2,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=5605,
        memory_gib=67.0,
        notes="as above, 16 hosts over 400 Gb/s RDMA per GPU",
    ),
    Published(
        label="Llama 3 8B, 64 A100, FSDP 64",
        source=TORCHTITAN_2024_A100 + " (Llama 3, selective op AC)",
        recipe="llama3.1-8b",
        gpu="a100-80gb",
        nodes=8,
        dp_shard=64,
        local_batch=1,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=2973,
        notes="no memory figure published; the cluster's network is not stated (DGX A100's "
        "200 Gb/s per GPU assumed)",
    ),
    Published(
        label="Llama 3 70B, 64 A100, FSDP 64",
        source=TORCHTITAN_2024_A100 + " (Llama 3, full AC)",
        recipe="llama3.1-70b",
        gpu="a100-80gb",
        nodes=8,
        dp_shard=64,
        local_batch=1,
        activation_checkpoint="full",
        tokens_per_s_per_gpu=331,
        notes="no memory figure published; network as above",
    ),
]
