"""Published GPU measurements of Llama training with FSDP, to hold the planner's predictions
against (docs/planner.md). Each row says where it comes from and on what hardware it ran.

All rows are torchtitan's (PyTorch's reference trainer for the same FSDP2 + DTensor stack),
bf16 without Float8 and without torch.compile (the rows that used them are left out). torchtitan
trains Llama 3 at sequence length 8192 and Llama 2 at 4096; its MFU figures only agree with those.
The two rows of the commit that moved torchtitan to FSDP2 (March 2024) are a Llama 2 7B at 2048
and give the allocator's peak *active* bytes (what this trainer's estimate predicts, allocated
blocks) beside the reserved peak; the later tables give the reserved peak only.

Where torchtitan's program differs from this trainer's, `predict_row` prices torchtitan's:
its selective checkpointing is op-level (it keeps every other matmul's output and recomputes
the others: k, o and up of each block), where this trainer's reruns no matmul on tp = 1. That
costs recompute time and saves their outputs' memory; `predicted_memory` counts both.

The estimate is of allocated bytes. A reserved peak is compared with it times torchtitan's own
reserved / active ratio for the same checkpointing (its FSDP2 commit measured both on one run).
The 2-D rows of that commit ran with record_stream on the tensor-parallel collectives, which
held their buffers until the GPU had finished them: their memory is shown, not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybrid2d import recipes
from hybrid2d.layout import RunLayout
from hybrid2d.planner import hardware as hwlib
from hybrid2d.planner.memory import estimate
from hybrid2d.planner.model import Candidate, predict

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
# power limit (below the SXM's 700 W), 400 Gb/s RDMA per GPU. Its footnote 2: "the actual peak
# TFLOPs number is between SXM and NVL, and we don't know its exact value". The rows are
# predicted at both ends: SXM 989.4 TFLOPS dense bf16 (H100 datasheet) and NVL 835.5 (H100 NVL
# datasheet: 1,671 TFLOPS bf16 with sparsity).
GRAND_TETON = {"memory_bytes": 96 * 2**30, "memory_bandwidth": 2.4e12}
H100_NVL_PEAK = 835.5e12
# Llama 2 shapes (HF meta-llama/Llama-2-13b-hf and -70b-hf config.json): no RoPE scaling,
# vocabulary 32,000; 13B without grouped-query attention.
LLAMA2_13B = {
    "dim": 5120,
    "n_layers": 40,
    "n_heads": 40,
    "n_kv_heads": 40,
    "ffn_dim": 13824,
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "rope_scaling_factor": 0.0,
    "max_position_embeddings": 4096,
}
LLAMA2_70B = {**LLAMA2_13B, "dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8}
LLAMA2_70B["ffn_dim"] = 28672
# torchtitan's "7B" of March 2024 (torchtrain/models/llama/__init__.py at the commit below): dim
# 4096, 32 layers, 32 heads, SwiGLU hidden 2/3 x 4 x 4096 rounded up to 256 = 11008, the Llama 2
# tokenizer's 32,000 tokens: Llama 2 7B's shape.
LLAMA2_7B = {**LLAMA2_13B, "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32}
LLAMA2_7B["ffn_dim"] = 11008
TORCHTITAN_FSDP2_COMMIT = (
    'torchtitan commit 83c879f (PR #165, "Used per-parameter FSDP", 2024-03-28), '
    "https://github.com/pytorch/torchtitan/commit/83c879f18763611bda68586c45f0082fd568d646"
)
# Its message gives memory as % of the GPU's 95.0396 GiB: "peak active" is the caching
# allocator's active_bytes.all.peak (torchtrain/metrics.py at that commit).
TORCHTITAN_FSDP2_GPU_GIB = 95.0396
# That commit's 1D FSDP2 runs (Llama 2 7B, 8 H100, local batch 8 x 2048): (peak active, peak
# reserved) as fractions of the GPU, per checkpointing ("23.92% peak active, 32.64% peak
# reserved"; selective: 52.13%, 62.51%). The reserved / active ratio compares reserved rows.
FSDP2_COMMIT_1D_PEAKS = {"full": (0.2392, 0.3264), "selective": (0.5213, 0.6251)}
RESERVED_OVER_ACTIVE = {ac: res / act for ac, (act, res) in FSDP2_COMMIT_1D_PEAKS.items()}
RECORD_STREAM_2D = (
    "memory not counted: at this commit tensor-parallel collectives ran with record_stream, which "
    "keeps their buffers from reuse until the GPU has finished them (torchtitan's "
    "docs/composability.md: 'unexpectedly high memory usage' with TP); torchtitan issue #191 "
    "found 2-D FSDP2 using 16 GB more than FSDP1 a week later, and commit e62573d (2024-04-10) "
    "set TORCH_NCCL_AVOID_RECORD_STREAMS=1, the default in PyTorch since 2025 (torchtitan "
    "681c66f) and so in this trainer's runs"
)


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
    memory_kind: str = "reserved"  # the allocator's reserved peak, or "active" (allocated)
    memory_not_counted: str = ""  # why the memory figure is not held to the target
    notes: str = ""
    model_changes: dict = field(default_factory=dict)  # where the model is not the recipe's
    peak_range: tuple = ()  # other peak FLOP/s the published machine may have had


# torchtitan's 2024 A100 table: 8 DGX-class hosts, 8-way FSDP each; no memory figures.
_A100_64 = {"gpu": "a100-80gb", "nodes": 8, "dp_shard": 64}
_LLAMA2_A100 = {
    **_A100_64,
    "recipe": "llama3.1-8b",
    "seq_len": 4096,
    "notes": "no memory figure published; network as above",
}
# The 2024-12 H100 table's Llama 3.1 8B rows.
_H100_8B = {
    "recipe": "llama3.1-8b",
    "gpu": "h100",
    "hardware_changes": GRAND_TETON,
    "local_batch": 2,
    "activation_checkpoint": "selective",
    "peak_range": (H100_NVL_PEAK,),
}
# The three runs of torchtitan's FSDP2 commit: Llama 2 7B on one Grand Teton host at 2048 tokens,
# memory as the allocator's peak active bytes.
_FSDP2_COMMIT_RUN = {
    "recipe": "llama3.1-8b",
    "model_changes": LLAMA2_7B,
    "gpu": "h100",
    "hardware_changes": GRAND_TETON,
    "seq_len": 2048,
    "memory_kind": "active",
    "peak_range": (H100_NVL_PEAK,),
}

ROWS = [
    Published(
        label="Llama 3.1 8B, 8 H100, FSDP 8",
        source=TORCHTITAN_2024_12 + " Table 1 (FSDP, eager)",
        **_H100_8B,
        tokens_per_s_per_gpu=5762,
        memory_gib=82.4,
        notes="H100 at 500 W with HBM2e (2.4 TB/s, 96 GB), peak between SXM and NVL; "
        "torchtitan's memory is its allocator's reserved peak, and its op-level selective AC "
        "keeps less than ours (every other matmul output; ours keeps all on tp 1): priced as "
        "torchtitan's",
    ),
    Published(
        label="Llama 3.1 8B, 128 H100, FSDP 128",
        source=TORCHTITAN_2024_12 + " Table 3 (FSDP, eager)",
        **_H100_8B,
        nodes=16,
        dp_shard=128,
        tokens_per_s_per_gpu=5605,
        memory_gib=67.0,
        notes="as above, 16 hosts over 400 Gb/s RDMA per GPU",
    ),
    Published(
        label="Llama 3 8B, 64 A100, FSDP 64",
        source=TORCHTITAN_2024_A100 + " (Llama 3, selective op AC)",
        recipe="llama3.1-8b",
        **_A100_64,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=2973,
        notes="no memory figure published; the cluster's network is not stated (DGX A100's "
        "200 Gb/s per GPU assumed); torchtitan's own MFU for it: 58.2%",
    ),
    Published(
        label="Llama 3 70B, 64 A100, FSDP 64",
        source=TORCHTITAN_2024_A100 + " (Llama 3, full AC)",
        recipe="llama3.1-70b",
        **_A100_64,
        activation_checkpoint="full",
        tokens_per_s_per_gpu=331,
        notes="no memory figure published; network as above",
    ),
    Published(
        label="Llama 2 13B, 64 A100, FSDP 64, no AC",
        source=TORCHTITAN_2024_A100 + " (Llama 2, no AC)",
        **_LLAMA2_A100,
        model_changes=LLAMA2_13B,
        local_batch=2,
        tokens_per_s_per_gpu=2162,
    ),
    Published(
        label="Llama 2 13B, 64 A100, FSDP 64, selective AC",
        source=TORCHTITAN_2024_A100 + " (Llama 2, selective op AC)",
        **_LLAMA2_A100,
        model_changes=LLAMA2_13B,
        local_batch=2,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=1904,
    ),
    Published(
        label="Llama 2 70B, 64 A100, FSDP 64, selective AC",
        source=TORCHTITAN_2024_A100 + " (Llama 2, selective op AC)",
        **_LLAMA2_A100,
        model_changes=LLAMA2_70B,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=355,
    ),
    Published(
        label="Llama 2 70B, 64 A100, FSDP 64, full AC",
        source=TORCHTITAN_2024_A100 + " (Llama 2, full AC)",
        **_LLAMA2_A100,
        model_changes=LLAMA2_70B,
        local_batch=2,
        activation_checkpoint="full",
        tokens_per_s_per_gpu=353,
    ),
    Published(
        label="Llama 2 7B, 8 H100, FSDP 8, full AC",
        source=TORCHTITAN_FSDP2_COMMIT + " (1D FSDP, eager, FSDP2 (AC))",
        **_FSDP2_COMMIT_RUN,
        local_batch=8,
        activation_checkpoint="full",
        tokens_per_s_per_gpu=6200,  # "6100-6300 WPS" (per GPU)
        memory_gib=FSDP2_COMMIT_1D_PEAKS["full"][0] * TORCHTITAN_FSDP2_GPU_GIB,
        notes="the same program as this trainer's where memory is concerned: whole-block "
        "checkpointing, bf16 parameters with fp32 reduce-scatter, the last block not resharded "
        "after forward, bf16 logits cast to fp32 for the loss; 95 GiB H100s as in the rows "
        "above; 32.64% (31.0 GiB) peak reserved",
    ),
    Published(
        label="Llama 2 7B, 8 H100, FSDP 8, selective AC",
        source=TORCHTITAN_FSDP2_COMMIT + " (1D FSDP, eager, FSDP2 (SAC))",
        **_FSDP2_COMMIT_RUN,
        local_batch=8,
        activation_checkpoint="selective",
        tokens_per_s_per_gpu=6700,  # "6600-6800 WPS"
        memory_gib=FSDP2_COMMIT_1D_PEAKS["selective"][0] * TORCHTITAN_FSDP2_GPU_GIB,
        notes="torchtitan's op-level selective AC of that commit (parallelize_llama.py: mm, SDPA "
        "and reduce-scatter outputs saved except every second mm), priced as such; 62.51% "
        "(59.4 GiB) peak reserved",
    ),
    Published(
        label="Llama 2 7B, 8 H100, FSDP 4 x TP 2, full AC",
        source=TORCHTITAN_FSDP2_COMMIT + " (2D FSDP, eager, FSDP2 (AC))",
        **_FSDP2_COMMIT_RUN,
        dp_shard=4,
        tp=2,
        local_batch=16,
        activation_checkpoint="full",
        tokens_per_s_per_gpu=5850,  # "5800-5900 WPS" (tokens / s / tp)
        memory_gib=0.5012 * TORCHTITAN_FSDP2_GPU_GIB,  # "50.12% peak active"
        memory_not_counted=RECORD_STREAM_2D,
        notes="sequence parallel and loss parallel as here; twice the 1D row's peak active "
        "memory with the same kept block inputs per rank",
    ),
]


def _k_o_up_features(m) -> int:
    """Output features of k, o and up: the matmuls of a block (the 2nd, 4th and 6th of q, k, v,
    o, gate, up, down) that torchtitan's op-level selective checkpointing recomputes."""
    return m.n_kv_heads * m.head_dim + m.n_heads * m.head_dim + m.ffn_dim


def torchtitan_recompute_flops(m) -> float:
    """FLOPs per token that torchtitan's op-level selective checkpointing recomputes."""
    return 2 * m.n_layers * m.dim * _k_o_up_features(m)


def torchtitan_unsaved_bytes(m, tokens: int, tp: int, c: int = 2) -> int:
    """Bytes per block that torchtitan's op-level selective checkpointing does not keep and this
    trainer's (tp = 1) does: the outputs of k, o and up."""
    return tokens * _k_o_up_features(m) // tp * c


def predicted_memory(row: Published) -> tuple[float, float]:
    """(GiB: the estimated allocated peak of torchtitan's program for the row, the figure to
    compare with the published one: the same, times RESERVED_OVER_ACTIVE for a reserved peak).

    On tp = 1 with selective checkpointing every moment that holds the blocks' saved tensors
    holds torchtitan_unsaved_bytes less per block (the last block's backward rebuilds its own,
    so one fewer there); the peak is the largest moment after that."""
    cfg = row_config(row)
    est = estimate(cfg, RunLayout.on_mesh(cfg, (1, row.dp_shard, row.tp)), 0, "cuda")
    totals = {name: sum(parts.values()) for name, parts in est.phases.items()}
    if row.activation_checkpoint == "selective" and row.tp == 1:
        m = cfg.model
        less = torchtitan_unsaved_bytes(m, row.local_batch * row.seq_len, row.tp)
        for name, blocks in (
            ("end of forward", m.n_layers),
            ("loss", m.n_layers),
            ("last block backward", m.n_layers - 1),
        ):
            totals[name] -= blocks * less
    allocated = max(totals.values()) / 2**30
    if row.memory_kind == "reserved":
        return allocated, allocated * RESERVED_OVER_ACTIVE[row.activation_checkpoint]
    return allocated, allocated


def row_config(row: Published):
    """The JobConfig of a published row: its recipe, model changes, batch and checkpointing."""
    cfg = recipes.get(row.recipe)
    if row.model_changes:
        cfg.model = dataclasses.replace(cfg.model, **row.model_changes)
    cfg.train.seq_len = row.seq_len
    cfg.train.global_batch = row.local_batch * row.dp_shard
    cfg.train.micro_batch = row.local_batch
    cfg.parallel.activation_checkpoint = row.activation_checkpoint
    return cfg


def predict_row(row: Published, peak_flops: float | None = None) -> tuple[Candidate, float]:
    """The planner's prediction for a published row's configuration (its hardware changes and,
    when given, another peak) and its tokens/s per GPU with torchtitan's recompute priced."""
    cfg = row_config(row)
    world = row.dp_shard * row.tp
    hw = hwlib.get(row.gpu)
    for key, value in row.hardware_changes.items():
        setattr(hw, key, value)
    if peak_flops:
        hw.peak_flops = peak_flops
    cand = predict(cfg, RunLayout.on_mesh(cfg, (1, row.dp_shard, row.tp)), hw, world // row.nodes)
    step = cand.step_s
    if row.activation_checkpoint == "selective":
        tokens = cfg.train.global_batch * row.seq_len / world
        ours = cand.details["recompute_flops_per_rank"]
        theirs = torchtitan_recompute_flops(cfg.model) * tokens
        rate = hw.matmul_rate(row.local_batch * row.seq_len, row.tp) * hw.eager_efficiency
        step += (theirs - ours) / rate  # torchtitan's rows ran eager
    return cand, cfg.train.global_batch * row.seq_len / step / world
