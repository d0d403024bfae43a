"""Every configuration of a job on a cluster, predicted and ranked; the best one as settings.

Candidates: every (dp_replicate, dp_shard, tp) whose product is the GPU count, x activation
checkpointing none / selective / full, x micro batch (each divisor of the per-rank batch). A
mesh the trainer would refuse (tp crossing a node, tp not dividing heads, kv heads, ffn or
vocab, a batch that does not split) is rejected with the reason, once per mesh. A planned
setting the user fixed (`fixed`: tools/plan.py --set parallel.tp=4) keeps its value in every
candidate, so the best plan is one the trainer runs with that setting as given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import MESH_DIMS, RunLayout, divisors
from hybrid2d.planner.hardware import Hardware
from hybrid2d.planner.model import DEFAULT_HEADROOM, Candidate, group_inside_node, predict_valid

CHECKPOINTING = ("none", "selective", "full")


@dataclass
class Rejected:
    dp_replicate: int
    dp_shard: int
    tp: int
    reason: str


@dataclass
class Plan:
    candidates: list[Candidate]  # best first; those that do not fit last
    rejected: list[Rejected]
    world: int
    gpus_per_node: int
    hardware: Hardware

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None


def meshes(world: int) -> list[tuple[int, int, int]]:
    """Every (dp_replicate, dp_shard, tp) of `world` ranks."""
    return [
        (rep, world // (tp * rep), tp) for tp in divisors(world) for rep in divisors(world // tp)
    ]


def plan(
    cfg: JobConfig,
    world_size: int,
    gpus_per_node: int,
    hardware: Hardware,
    headroom: float = DEFAULT_HEADROOM,
    model: ModelConfig | None = None,
    fixed: Collection[str] = (),
    documents: bool = False,
) -> Plan:
    """Predict every valid candidate; rank fitting ones by step time, then the rest by memory.
    `model`: the shape to plan for in place of cfg.model's (an init_from checkpoint's).
    `fixed`: names from PLANNED whose value in cfg every candidate keeps (the others are the
    search's to choose). `documents`: rows packed with several documents (`predict`)."""
    if world_size < 1 or gpus_per_node < 1:
        raise ConfigError(f"world size {world_size} and GPUs per node {gpus_per_node} must be >= 1")
    keep = fixed_values(cfg, fixed)
    modes = (keep["activation_checkpoint"],) if "activation_checkpoint" in keep else CHECKPOINTING
    out: list[Candidate] = []
    rejected: list[Rejected] = []
    for mesh in meshes(world_size):
        if any(keep.get(dim, size) != size for dim, size in zip(MESH_DIMS, mesh, strict=True)):
            continue
        base = mesh_layout(cfg, mesh, gpus_per_node, model, keep.get("micro_batch", 0))
        if isinstance(base, str):
            rejected.append(Rejected(*mesh, base))
            continue
        # valid by construction: a fixed micro batch was checked by mesh_layout
        micros = [base.micro_batch] if "micro_batch" in keep else divisors(base.local_batch)
        for ac in modes:
            for micro in micros:
                layout = dataclasses.replace(base, activation_checkpoint=ac, micro_batch=micro)
                out.append(predict_valid(cfg, layout, hardware, gpus_per_node, headroom, documents))
    out.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.peak_gib))
    return Plan(out, rejected, world_size, gpus_per_node, hardware)


def fixed_values(cfg: JobConfig, fixed: Collection[str]) -> dict[str, object]:
    """Candidate field -> cfg's value, for each name of `fixed` (names from PLANNED); dp_shard
    -1 ('what the world size leaves') fixes nothing."""
    out: dict[str, object] = {}
    for name in fixed:
        section, field = name.split(".")
        value = getattr(getattr(cfg, section), field)
        if (field, value) != ("dp_shard", -1):
            out[field] = value
    return out


def mesh_layout(
    cfg: JobConfig,
    mesh: tuple[int, int, int],
    gpus_per_node: int,
    model: ModelConfig | None,
    micro_batch: int = 0,
) -> RunLayout | str:
    """cfg laid out on this mesh, or why the trainer cannot run it there. `micro_batch`: a fixed
    one, which the mesh's per-rank batch must split into; 0 (the whole per-rank batch) for a
    search that chooses it, so that it is not the mesh's problem."""
    if not group_inside_node(mesh[2], gpus_per_node):
        return f"tp={mesh[2]} crosses nodes ({gpus_per_node} GPUs per node)"
    try:
        return RunLayout.on_mesh(cfg, mesh, micro_batch=micro_batch, model=model)
    except ConfigError as e:
        return str(e)


def best_plan(
    cfg: JobConfig,
    world_size: int,
    gpus_per_node: int,
    hardware: Hardware,
    headroom: float = DEFAULT_HEADROOM,
    model: ModelConfig | None = None,
    documents: bool = False,
) -> Candidate:
    """The fastest candidate that fits; ConfigError naming the smallest peak when none fits."""
    result = plan(
        cfg, world_size, gpus_per_node, hardware, headroom, model=model, documents=documents
    )
    if result.best is not None:
        return result.best
    if not result.candidates:
        first = result.rejected[0].reason if result.rejected else "no mesh"
        raise ConfigError(f"no valid configuration of {cfg.recipe} on {world_size} GPUs ({first})")
    smallest = min(result.candidates, key=lambda c: c.peak_gib)
    raise ConfigError(
        f"no configuration of {cfg.recipe} fits {world_size} x {hardware.name}: the smallest "
        f"peak is {smallest.peak_gib:.1f} GiB per rank (dp_replicate={smallest.dp_replicate} "
        f"dp_shard={smallest.dp_shard} tp={smallest.tp} {smallest.activation_checkpoint} "
        f"checkpointing, micro batch {smallest.micro_batch}) against "
        f"{smallest.memory_limit_gib:.1f} GiB; use more GPUs or a smaller train.seq_len"
    )


def fewest_gpus(
    cfg: JobConfig,
    hardware: Hardware,
    headroom: float = DEFAULT_HEADROOM,
    model: ModelConfig | None = None,
    above: int = 0,
    max_nodes: int = 512,
) -> Plan | None:
    """The plan on the fewest GPUs, more than `above`, on which some candidate fits: the way
    out for a job that fits no mesh of its GPU count. GPU counts tried, smallest first: 1, 2,
    4... below one node, then 1 to 16 whole nodes, then 32, 64, ... up to `max_nodes` nodes
    (a job that needs more than 16 nodes is told a power of two). None when none fits."""
    per_node = hardware.gpus_per_node
    small = [w for w in (1, 2, 4, 8, 16, 32) if w < per_node]
    nodes = list(range(1, 17)) + [
        2**k for k in range(5, max_nodes.bit_length()) if 2**k <= max_nodes
    ]
    for world in small + [per_node * n for n in nodes]:
        if world <= above:
            continue
        result = plan(cfg, world, per_node, hardware, headroom, model=model)
        if result.best is not None:
            return result
    return None


# ---- output ----------------------------------------------------------------------------------


def mesh_label(c: Candidate | Rejected) -> str:
    """rep x shard x tp, always all three (as the table's header says)."""
    return f"{c.dp_replicate}x{c.dp_shard}x{c.tp}"


def param_count(n: float) -> str:
    """A parameter count people read: 5.0M, 8.0B, 1.2T (plain below a thousand)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def format_table(result: Plan, top: int, show_rejected: bool = False) -> str:
    """Ranked candidates (best first, non-fitting last) with their breakdown and reason."""
    header = (
        "| # | mesh (rep x shard x tp) | ckpt | micro | fits | peak GiB | step s | compute s "
        "| tp comm s | FSDP comm s | optim s | tok/s/GPU | MFU | why |"
    )
    lines = [header, "|" + "---|" * 14]
    for i, c in enumerate(result.candidates[:top], 1):
        lines.append(
            f"| {i} | {mesh_label(c)} | {c.activation_checkpoint} | {c.micro_batch} | "
            f"{'yes' if c.fits else 'no'} | {c.peak_gib:.1f} | {c.step_s:.3g} | "
            f"{c.compute_s:.3g} | {c.tp_comm_s:.3g} | {c.fsdp_comm_s:.3g} | "
            f"{c.optimizer_s:.3g} | {c.tokens_per_s_per_gpu:,.0f} | {100 * c.mfu:.1f}% | "
            f"{c.reason} |"
        )
    rest = len(result.candidates) - top
    if rest > 0:
        lines.append(f"\n{rest} more candidates (--top {len(result.candidates)} lists them)")
    if show_rejected and result.rejected:
        lines += ["", "rejected meshes:", "| mesh | reason |", "|---|---|"]
        lines += [f"| {mesh_label(r)} | {r.reason} |" for r in result.rejected]
    elif result.rejected:
        lines.append(f"{len(result.rejected)} meshes rejected (--show-rejected lists why)")
    return "\n".join(lines)


def accelerate_config(c: Candidate, nodes: int, comment: str) -> str:
    """An accelerate config file (`accelerate launch --config_file`) for this candidate, in the
    format of recipes/accelerate/*.yaml; hybrid2d builds the mesh from the parallelism sizes."""
    world = c.dp_replicate * c.dp_shard * c.tp
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: FSDP",
        "fsdp_config:",
        "  fsdp_version: 2",
        "parallelism_config:",
        f"  parallelism_config_dp_replicate_size: {c.dp_replicate}",
        f"  parallelism_config_dp_shard_size: {c.dp_shard}",
        f"  parallelism_config_tp_size: {c.tp}",
        "machine_rank: 0",
        f"num_machines: {nodes}",
        f"num_processes: {world}",
    ]
    if nodes > 1:
        lines.append("main_process_port: 29500")
    lines += [
        "main_training_function: main",
        "mixed_precision: 'no'  # hybrid2d applies bf16 itself (parallel.mixed_precision=auto)",
        "rdzv_backend: static",
        "same_network: true",
        "use_cpu: false",
    ]
    return "\n".join(lines) + "\n"
