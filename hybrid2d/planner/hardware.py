"""Hardware profiles: what one device computes and moves, each figure with where it comes from.

A profile holds two kinds of figures, kept apart on purpose:

- vendor figures (peak dense bf16 FLOP/s without sparsity, memory, HBM bandwidth, NVLink and
  network bandwidth per GPU), each with its datasheet in `sources`;
- achieved fractions of those peaks (matmul, attention, elementwise memory traffic, links) and
  link latencies. For the presets these are stated assumptions, not measurements; `tools/plan.py
  --calibrate` measures them on the machine it runs on and writes a profile (JSON) that
  `--hardware FILE.json` reads back.

Bandwidths are bytes/s per device in one direction (NVLink "900 GB/s" is both directions of one
H100, so 450e9 here; a 400 Gb/s NIC per GPU is 50e9). A collective over n ranks costs
`latency + factor * payload / bandwidth`, factor (n-1)/n for all-gather and reduce-scatter and
2(n-1)/n for all-reduce (ring), where the payload is the full (unsharded) buffer as in
`comm.py`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from hybrid2d.errors import ConfigError
from hybrid2d.paths import read_profile

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank sends, as a fraction of the payload, for a ring collective of n ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


@dataclass
class Link:
    """One class of link (inside a node or across nodes)."""

    bandwidth: float  # bytes/s per device, one direction (vendor peak, or measured)
    efficiency: float = 1.0  # achieved fraction of `bandwidth` (1.0 for measured figures)
    latency_s: float = 0.0  # per collective
    # Measured per collective kind: {kind: [latency_s, bytes/s]}; overrides the three above.
    measured: dict[str, list[float]] = field(default_factory=dict)

    def seconds(self, kind: str, n: int, payload: float, count: int = 1) -> float:
        """Time of `count` collectives of `kind` over n ranks moving `payload` bytes in all."""
        if n <= 1 or count == 0:
            return 0.0
        if kind in self.measured:
            latency, bandwidth = self.measured[kind]
        else:
            latency, bandwidth = self.latency_s, self.bandwidth * self.efficiency
        return count * latency + ring_factor(kind, n) * payload / bandwidth


@dataclass
class Hardware:
    """One device of a cluster (a GPU, or for CPU profiles one host whose cores ranks share)."""

    name: str
    description: str
    target: str  # "cuda" (bf16 compute, estimate's cuda figures) or "cpu" (fp32)
    peak_flops: float  # dense bf16 per GPU; CPU: the best measured matmul rate of the host
    memory_bytes: int  # per device (CPU: the host's RAM)
    memory_bandwidth: float  # bytes/s (HBM peak; CPU: measured elementwise traffic)
    gpus_per_node: int
    intra: Link  # inside a node (NVLink; CPU: shared memory between processes)
    inter: Link  # across nodes (InfiniBand / RoCE; CPU: gloo over TCP)
    matmul_efficiency: float = 1.0  # achieved fraction of peak_flops in the model's matmuls
    attention_efficiency: float = 1.0  # same for fused attention (SDPA / flash attention)
    memory_efficiency: float = 1.0  # achieved fraction of memory_bandwidth in elementwise ops
    # Eager PyTorch (parallel.compile off): its kernels' speed as a fraction of what the rates
    # above give, which is what a compiled step reaches on GPUs (unfused elementwise kernels,
    # launch gaps). 1.0 where the rates were measured eager (calibrated profiles).
    eager_efficiency: float = 1.0
    # Calibrated: [[tokens, tp, flop/s], ...] at the model's shapes (overrides matmul_efficiency),
    # [[tokens, tp, flop/s], ...] for attention, [[tokens, bytes/s], ...] for elementwise ops.
    matmul_table: list[list[float]] = field(default_factory=list)
    attention_table: list[list[float]] = field(default_factory=list)
    elementwise_table: list[list[float]] = field(default_factory=list)
    optimizer_s_per_param: float = 0.0  # calibrated AdamW step + clipping; 0: from bandwidth
    # Per tp collective: the wait for the other ranks when it follows compute (calibrated; the
    # link figures are measured back to back, with the ranks already in step). 0: none.
    tp_sync_s: float = 0.0
    # Per block and micro batch, per checkpointing mode: what it costs beyond the recompute the
    # model prices (calibrated; on CPU the per-op overhead of checkpointing's dispatch modes).
    checkpoint_overhead_s: dict[str, float] = field(default_factory=dict)
    # Per block and micro batch (tp 1, no checkpointing): what one block's measured forward +
    # backward takes beyond the matmuls, attention, elementwise traffic and ops the model
    # prices for it, as {"fixed": s, "per_token": s} (calibrated at one and two samples; the
    # per-token part splits over tp). Empty: none.
    block_residual_s: dict[str, float] = field(default_factory=dict)
    # Per block and micro batch when tp > 1: what one block sharded by the trainer's plan takes
    # beyond all of the above and its priced tp collectives (calibrated at the processes'
    # tp; the wrappers, autograd functions and waits of the parallel forward). 0: none.
    tp_block_overhead_s: float = 0.0
    # CPU, when more ranks share the host than it has cores: per block and micro batch, per tp
    # ({"2": s, "4": s}), what a tp-sharded block took beyond everything priced (each term at
    # its crowded share) with `crowded_ranks` processes measuring at once; on such a host each
    # tp collective waits for a peer the scheduler has not run yet. Replaces the uncrowded
    # `tp_block_overhead_s` x ranks / cores for a tp it holds. Empty: not measured.
    crowded_tp_block_overhead_s: dict[str, float] = field(default_factory=dict)
    crowded_ranks: int = 0
    # Per block and micro batch when dp_shard > 1: what one block as an FSDP2 unit takes beyond
    # the block and its priced all-gathers, reduce-scatter, copies and ops (calibrated; FSDP2's
    # hooks, waits and allocations). 0: none.
    fsdp_block_overhead_s: float = 0.0
    # CPU seconds per dispatched aten op (Python, dispatcher, autograd, hooks), whatever its size;
    # `planner/ops.py` counts the ops of a step. CPU: per core, added to compute (the same
    # thread runs both); GPU: the host runs ahead of the kernels, so only what exceeds the
    # step's kernel time is exposed. 0 (profiles written before it existed): not priced.
    op_overhead_s: float = 0.0
    # CPU: the host's cores, which the ranks of a node share (each rank gets cores / ranks
    # threads; the calibrated rates are per core). None for GPUs (a device per rank).
    host_cores: int | None = None
    # Whether FSDP's collectives run beside compute (GPUs: NCCL on its own stream). CPU: the
    # copies of a collective take the same cores as compute, so nothing is hidden.
    comm_overlap: bool = True
    sources: dict[str, str] = field(default_factory=dict)

    # ---- achieved rates ---------------------------------------------------------------------

    def matmul_rate(self, tokens: int, tp: int) -> float:
        """Achieved matmul FLOP/s of a micro batch of `tokens` at `tp` (CPU profiles: per core;
        `host_share` scales it to what one rank gets)."""
        if self.matmul_table:
            return _lookup(self.matmul_table, tokens, tp)
        return self.peak_flops * self.matmul_efficiency

    def attention_rate(self, tokens: int, tp: int) -> float:
        if self.attention_table:
            return _lookup(self.attention_table, tokens, tp)
        return self.peak_flops * self.attention_efficiency

    def elementwise_bandwidth(self, tokens: int) -> float:
        if self.elementwise_table:
            rows = [[t, 1, bw] for t, bw in self.elementwise_table]
            return _lookup(rows, tokens, 1)
        return self.memory_bandwidth * self.memory_efficiency

    def residual_per_block(self, tokens: float, tp: int) -> float:
        """`block_residual_s` for one block and micro batch of `tokens` tokens over `tp` ranks."""
        residual = self.block_residual_s
        return residual.get("fixed", 0.0) + residual.get("per_token", 0.0) * tokens / tp

    def host_share(self, ranks_on_host: int) -> float:
        """How much faster (>1) or slower (<1) a rank computes than one calibrated core: the
        cores a rank gets when `ranks_on_host` ranks share the host. 1.0 for GPUs."""
        if not self.host_cores:
            return 1.0
        return self.host_cores / max(1, ranks_on_host)

    # ---- files ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "hardware profile") -> Hardware:
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{where}: unknown field {unknown[0]!r}; fields are {sorted(names)}")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in d]
        if missing:
            raise ConfigError(f"{where}: missing field {missing[0]!r}")
        link_names = {f.name for f in dataclasses.fields(Link)}
        for side in ("intra", "inter"):
            link = d[side]
            if not isinstance(link, dict) or "bandwidth" not in link:
                raise ConfigError(f"{where}: {side} must be an object with a bandwidth (bytes/s)")
            bad = sorted(set(link) - link_names)
            if bad:
                raise ConfigError(f"{where}: {side}.{bad[0]} is not one of {sorted(link_names)}")
            d[side] = Link(**link)
        hw = cls(**d)
        hw.check(where)
        return hw

    def check(self, where: str = "hardware profile") -> None:
        if self.target not in ("cuda", "cpu"):
            raise ConfigError(f"{where}: target={self.target!r} is not one of cuda, cpu")
        for name in ("peak_flops", "memory_bytes", "memory_bandwidth", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{where}: {name}={value!r} must be a number > 0")
        if not 0 < self.eager_efficiency <= 1:
            raise ConfigError(
                f"{where}: eager_efficiency={self.eager_efficiency!r} must be in (0, 1]"
            )
        for name in ("intra", "inter"):
            link = getattr(self, name)
            if not link.bandwidth > 0 or not 0 < link.efficiency <= 1:
                raise ConfigError(f"{where}: {name} needs bandwidth > 0 and 0 < efficiency <= 1")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def _lookup(table: list[list[float]], tokens: int, tp: int) -> float:
    """Rate at (tokens, tp) from measured [tokens, tp, rate] rows: the nearest measured tp,
    linear in log(tokens) between measured token counts, clamped at the ends."""
    tps = sorted({int(r[1]) for r in table})
    near = min(tps, key=lambda t: (abs(math.log(t) - math.log(max(tp, 1))), t))
    rows = sorted((r[0], r[2]) for r in table if int(r[1]) == near)
    xs = [math.log(r[0]) for r in rows]
    x = math.log(max(tokens, 1))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return rows[0][1]
    if i == len(rows):
        return rows[-1][1]
    (x0, y0), (x1, y1) = (xs[i - 1], rows[i - 1][1]), (xs[i], rows[i][1])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# ---- presets ---------------------------------------------------------------------------------

GB = 10**9  # vendor bandwidths are decimal
GiB = 2**30

# Achieved fractions: assumptions, the same for every preset unless a source says otherwise.
_ASSUMED = {
    "memory_efficiency": "assumption: unfused elementwise kernels stream at about 80% of peak HBM "
    "bandwidth (STREAM-like copies reach 80-90%)",
    "intra.efficiency": "assumption: NCCL ring bus bandwidth over NVLink is about 80% of the "
    "per-direction link figure (nccl-tests all-reduce busbw on 8 GPUs)",
    "inter.efficiency": "assumption: about 80% of the NIC's line rate",
    "intra.latency_s": "assumption: 15 us per NCCL collective inside a node (small messages)",
    "inter.latency_s": "assumption: 30 us per NCCL collective across nodes",
    "op_overhead_s": "assumption: 10 us of host CPU per eager op on CUDA (Python, dispatcher, "
    "autograd, cudaLaunchKernel: about 5-25 us by layer, "
    "https://jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html; the "
    "'overhead' regime of https://horace.io/brrr_intro.html). Measure it: tools/plan.py "
    "--calibrate --device cuda",
}
# Matmul: the Maximum Achievable Matmul FLOPS table (stas00/ml-engineering,
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table", BF16, v2
# benchmark: mean of 100 iterations of torch.matmul at the best shape found), an upper bound for
# the model's large GEMMs (8B at 8k tokens: 16384 x 4096 x 4096..14336).
_MAMF = "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md"
_MAMF_A100 = (0.869, f"MAMF table ({_MAMF}): A100 SXM 271.2 of 312 TFLOPS bf16 = 86.9%")
_MAMF_H100 = (0.803, f"MAMF table ({_MAMF}): H100 SXM 794.5 of 989 TFLOPS bf16 = 80.3%")
_MAMF_H200 = (
    0.803,
    f"MAMF table ({_MAMF}) has no H200 SXM row: the H100 SXM's 80.3% taken (the same GH100 "
    "compute at 700 W; the 900 W GH200 reaches 83.6%)",
)
_MAMF_B200 = (
    0.75,
    "assumption: no public MAMF figure for B200; 0.75 taken (Hopper and Ampere reach 80-87%). "
    "Measure it: tools/plan.py --calibrate --device cuda",
)
# Attention: the FlashAttention papers count backward as 2.5x forward FLOPs (5 matmuls, as the
# kernel recomputes the scores); flops_per_token counts it as 2x (12 per forward 4). A kernel
# reaching fraction e of peak by the papers' count reaches e x 3 / 3.5 by the model's.
_FA_COUNT = 3 / 3.5
_FA2 = (
    0.5 * _FA_COUNT,
    "FlashAttention-2 (Dao, 2023, arXiv:2307.08691, section 4.1): forward reaches 50-73% of "
    "A100 peak, backward less, counting backward as 2.5x forward FLOPs; 0.5 taken, x 3/3.5 for "
    "flops_per_token's 2x backward: 0.43",
)
_FA3_H = (
    0.35 * _FA_COUNT,
    "FlashAttention-3 (Shah et al., 2024, arXiv:2407.08608): FlashAttention-2 (PyTorch's SDPA "
    "flash backend) reaches about 35% of H100 peak by the papers' count (backward 2.5x "
    "forward); x 3/3.5 for flops_per_token's 2x backward: 0.30",
)

# Eager against compiled, measured on one H200 (docs/gpu-check-h200.json, 2026-12-04): the same
# llama3.2-1b step (bf16, micro batch 8, no checkpointing) took 0.666 s eager and 0.539 s with
# parallel.compile, where the preset's ceilings above priced 0.535 s. The ratio is taken for every
# GPU: no other GPU has been measured, and the published A100 and H100 rows (docs/planner.md) are
# the check of that.
_EAGER = (
    0.81,
    "measured: one H200, llama3.2-1b bf16 micro batch 8, 0.539 s compiled / 0.666 s eager = 0.81 "
    "(docs/gpu-check-h200.json; the preset priced the compiled step at 0.535 s); taken for "
    "every GPU",
)


def _gpu(
    name, description, peak, memory_gib, hbm, nvlink_dir, nic_dir, matmul, attention, sources
) -> Hardware:
    return Hardware(
        name=name,
        description=description,
        target="cuda",
        peak_flops=peak,
        memory_bytes=int(memory_gib * GiB),
        memory_bandwidth=hbm,
        gpus_per_node=8,
        intra=Link(bandwidth=nvlink_dir, efficiency=0.8, latency_s=15e-6),
        inter=Link(bandwidth=nic_dir, efficiency=0.8, latency_s=30e-6),
        op_overhead_s=10e-6,
        matmul_efficiency=matmul[0],
        attention_efficiency=attention[0],
        memory_efficiency=0.8,
        eager_efficiency=_EAGER[0],
        comm_overlap=True,
        sources={
            **sources,
            **_ASSUMED,
            "matmul_efficiency": matmul[1],
            "attention_efficiency": attention[1],
            "eager_efficiency": _EAGER[1],
        },
    )


PRESETS: dict[str, Hardware] = {
    "h100": _gpu(
        "h100",
        "NVIDIA H100 SXM5 80GB, 8 per node (DGX/HGX H100), NVLink 4, 400 Gb/s per GPU",
        989.4e12,
        80,
        3.35e12,
        450 * GB,
        50 * GB,
        _MAMF_H100,
        _FA3_H,
        {
            "peak_flops": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core "
            "1,979 TFLOPS with sparsity; dense (no sparsity) is half, 989.4 TFLOPS",
            "memory_bytes": "H100 datasheet, H100 SXM: 80 GB HBM3 (HBM capacities are binary: "
            "nvidia-smi shows 81,559 MiB); 80 GiB",
            "memory_bandwidth": "H100 datasheet, H100 SXM: 3.35 TB/s",
            "intra.bandwidth": "H100 datasheet, H100 SXM: NVLink 900 GB/s (both directions); "
            "450 GB/s each way",
            "inter.bandwidth": "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU; "
            "50 GB/s each way",
            "gpus_per_node": "DGX H100 / HGX H100: 8 GPUs",
        },
    ),
    "h200": _gpu(
        "h200",
        "NVIDIA H200 SXM 141GB, 8 per node (DGX/HGX H200), NVLink 4, 400 Gb/s per GPU",
        989.4e12,
        141,
        4.8e12,
        450 * GB,
        50 * GB,
        _MAMF_H200,
        (_FA3_H[0], _FA3_H[1] + " (H200 has the H100's compute)"),
        {
            "peak_flops": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 Tensor Core "
            "1,979 TFLOPS with sparsity; dense is half, 989.4 TFLOPS",
            "memory_bytes": "H200 datasheet, H200 SXM: 141 GB HBM3e",
            "memory_bandwidth": "H200 datasheet, H200 SXM: 4.8 TB/s",
            "intra.bandwidth": "H200 datasheet: NVLink 900 GB/s (both directions); 450 GB/s "
            "each way",
            "inter.bandwidth": "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU; "
            "50 GB/s each way",
            "gpus_per_node": "DGX H200 / HGX H200: 8 GPUs",
        },
    ),
    "a100-80gb": _gpu(
        "a100-80gb",
        "NVIDIA A100 SXM4 80GB, 8 per node (DGX A100), NVLink 3, 200 Gb/s per GPU",
        312e12,
        80,
        2.039e12,
        300 * GB,
        25 * GB,
        _MAMF_A100,
        _FA2,
        {
            "peak_flops": "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 Tensor "
            "Core 312 TFLOPS (624 with sparsity)",
            "memory_bytes": "A100 datasheet: 80 GB HBM2e",
            "memory_bandwidth": "A100 datasheet, A100 80GB SXM: 2,039 GB/s",
            "intra.bandwidth": "A100 datasheet: NVLink 600 GB/s (both directions); 300 GB/s "
            "each way",
            "inter.bandwidth": "NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s "
            "HDR InfiniBand, one per GPU; 25 GB/s each way",
            "gpus_per_node": "DGX A100 / HGX A100: 8 GPUs",
        },
    ),
    "b200": _gpu(
        "b200",
        "NVIDIA B200 (HGX/DGX B200, 1,000 W), 8 per node, NVLink 5, 400 Gb/s per GPU",
        2.25e15,
        180,
        8.0e12,
        900 * GB,
        50 * GB,
        _MAMF_B200,
        (_FA3_H[0], _FA3_H[1] + "; no published Blackwell figure, Hopper's taken"),
        {
            "peak_flops": "NVIDIA HGX B200 specifications: FP16/BF16 Tensor Core 4.5 PFLOPS per "
            "GPU with sparsity; dense is half, 2.25 PFLOPS",
            "memory_bytes": "NVIDIA DGX B200 datasheet: 1,440 GB of GPU memory for 8 GPUs, "
            "180 GB each",
            "memory_bandwidth": "DGX B200 datasheet: 64 TB/s HBM3e for 8 GPUs, 8 TB/s each",
            "intra.bandwidth": "NVLink 5: 1.8 TB/s per GPU (both directions); 900 GB/s each way",
            "inter.bandwidth": "DGX B200 datasheet: 8x single-port ConnectX-7 VPI, 400 Gb/s, "
            "one per GPU; 50 GB/s each way",
            "gpus_per_node": "DGX B200 / HGX B200: 8 GPUs",
        },
    ),
}


def host_memory_bytes() -> int:
    """This host's physical RAM (16 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def cpu_guess() -> Hardware:
    """A rough profile of this CPU host, for planning before `--calibrate` has been run."""
    cores = os.cpu_count() or 1
    memory = host_memory_bytes()
    guess = "rough guess for an x86-64 core; measure with tools/plan.py --calibrate --device cpu"
    return Hardware(
        name="cpu",
        description=f"this host ({cores} cores), uncalibrated",
        target="cpu",
        peak_flops=50e9 * cores,
        memory_bytes=int(memory),
        memory_bandwidth=5e9,
        gpus_per_node=cores,
        intra=Link(bandwidth=3e9, latency_s=50e-6),
        inter=Link(bandwidth=1e9, latency_s=200e-6),
        matmul_table=[[256, 1, 40e9]],
        attention_table=[[256, 1, 10e9]],
        elementwise_table=[[256, 5e9]],
        optimizer_s_per_param=2e-9,
        op_overhead_s=20e-6,
        host_cores=cores,
        comm_overlap=False,
        sources={"all": guess},
    )


def preset_for_device(device_name: str) -> str | None:
    """The preset of the GPU a CUDA device name names ("NVIDIA H100 80GB HBM3": h100), or None."""
    return next((key for key in PRESETS if key.split("-")[0] in device_name.lower()), None)


def names() -> list[str]:
    return [*PRESETS, "cpu"]


def get(name: str) -> Hardware:
    """A preset by name (a fresh copy, safe to change)."""
    if name == "cpu":
        return cpu_guess()
    if name not in PRESETS:
        raise ConfigError(f"--gpu {name!r} is not one of {', '.join(names())}")
    return Hardware.from_dict(PRESETS[name].to_dict(), f"preset {name}")


def load(path: str) -> Hardware:
    """A profile from a JSON file (as `--calibrate --out` writes, or by hand)."""
    return Hardware.from_dict(read_profile(path), f"--hardware {path}")
