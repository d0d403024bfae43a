"""The planner at the start of a run: the profile of the machine it launched on, the prediction
for the launched configuration (its line, and the check that its peak fits a rank), and
`parallel.plan=auto` (take the best plan for this world)."""

from __future__ import annotations

import torch

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.data.build import data_kind
from hybrid2d.data.corpus import source_files
from hybrid2d.errors import ConfigError
from hybrid2d.launcher import LAUNCHER_MESH_ENV, launched_mesh_env
from hybrid2d.layout import RunLayout
from hybrid2d.mesh import Mesh
from hybrid2d.planner import hardware as profiles
from hybrid2d.planner.hardware import Hardware, host_memory_bytes
from hybrid2d.planner.model import PLANNED, Candidate, predict
from hybrid2d.planner.search import best_plan


def profile_for(setting: str, device_type: str) -> Hardware:
    """parallel.plan_hardware: a preset name, a profile JSON file (tools/plan.py --calibrate),
    or "" for this machine: the preset matching the CUDA device's name (its memory as the
    device reports it), else the rough CPU guess."""
    if setting.endswith(".json"):
        return profiles.load(setting)
    if setting:
        return profiles.get(setting)
    if device_type != "cuda":
        return profiles.get("cpu")
    name = torch.cuda.get_device_name()
    preset = profiles.preset_for_device(name)
    hw = profiles.get(preset or "h100")
    hw.memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if preset is None:  # said in the plan line (guess_note), not silently taken for an H100
        hw.description = f"{name} has no preset: h100's figures, a guess"
    return hw


def planner_profile(cfg: JobConfig, device_type: str) -> Hardware:
    try:
        return profile_for(cfg.parallel.plan_hardware, device_type)
    except ConfigError as e:
        raise ConfigError(f"parallel.plan_hardware={cfg.parallel.plan_hardware!r}: {e}") from None


def guess_note(hw: Hardware) -> str:
    """Why the profile's figures are only a guess for this machine, with the way to measure
    them; "" for a preset or a calibrated profile."""
    if hw.name == "cpu" or hw.description.endswith("a guess"):
        return (
            f"{hw.description}; measure this machine with tools/plan.py --calibrate "
            f"--device {hw.target} --out FILE.json, then --parallel.plan_hardware FILE.json"
        )
    return ""


def packed_documents(cfg: JobConfig) -> bool:
    """Whether the run's rows hold several documents apart (per-row masks and positions, which
    the memory estimate's `documents` prices): packed instruction data, or text with
    data.document_mask on. Instruction data is told by its files' first line (data_kind),
    read only when the settings leave the kind open."""
    d = cfg.data
    if d.document_mask == "on":  # text only (instruction data refuses it)
        return True
    if not d.path or d.format == "text" or d.packing == "padded":
        return False
    return data_kind(cfg, source_files(d)) == "instruct"


def prediction(cfg: JobConfig, layout: RunLayout, hw: Hardware, per_node: int) -> Candidate:
    """The planner's figures for exactly this layout (packed rows priced as such)."""
    gpus = max(per_node, layout.tp)
    return predict(cfg, layout, hw, gpus_per_node=gpus, documents=packed_documents(cfg))


def planned(cfg: JobConfig, mesh: Mesh, hw: Hardware, per_node: int) -> dict:
    """The planner's prediction for the launched configuration (step time, peak per rank)."""
    try:
        c = prediction(cfg, mesh.layout, hw, per_node)
    except ConfigError as e:  # the planner cannot price it: say so, train anyway
        return {"hardware": hw.name, "error": str(e)}
    return {
        "hardware": hw.name,
        "step_s": c.step_s,
        "peak_bytes": round(c.peak_gib * 2**30),
        "guess": guess_note(hw),
    }


def describe_plan(plan: dict) -> str:
    """The start-of-run line of `planned`'s prediction (the summary puts the measured beside it)."""
    if "error" in plan:
        return f"plan ({plan['hardware']}): no prediction: {plan['error']}"
    guess = f"; {plan['guess']}" if plan["guess"] else ""
    return (
        f"plan ({plan['hardware']} profile): predicted {plan['step_s']:.3g} s/step, "
        f"{plan['peak_bytes'] / 2**30:.3g} GiB peak per rank{guess}"
    )


def memory_per_rank(device: torch.device, ranks_on_host: int) -> tuple[int, str]:
    """(bytes, what) a rank may use: its CUDA device's memory, or the host's RAM shared by
    the ranks on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the CUDA device's"
    share = host_memory_bytes() // max(ranks_on_host, 1)
    return share, f"this host's RAM over its {ranks_on_host} rank(s)"


def check_planned_memory(plan: dict, mesh: Mesh, ranks_on_host: int) -> None:
    """ConfigError when the plan's peak per rank is more than a rank has: the run would end in
    an out-of-memory error (or the OOM killer) after data and model were built."""
    if "peak_bytes" not in plan:
        return
    have, what = memory_per_rank(mesh.device, ranks_on_host)
    if plan["peak_bytes"] > have:
        raise ConfigError(
            f"the plan puts this run's peak at {plan['peak_bytes'] / 2**30:.3g} GiB per rank, "
            f"more than {what} {have / 2**30:.3g} GiB; use more ranks (dp_shard or tp), "
            "--parallel.activation_checkpoint full or a smaller --train.micro_batch "
            "(tools/plan.py ranks what fits), or --parallel.check_memory false to try anyway"
        )


def auto_plan(
    cfg: JobConfig,
    world: int,
    per_node: int,
    hw: Hardware,
    set_on_cli: set[str] | frozenset[str],
    model: ModelConfig | None = None,
) -> tuple[dict, str]:
    """parallel.plan=auto: the mesh, checkpointing and micro batch of the best plan for `world`
    ranks, as RunLayout.build's keywords, and one line saying what was taken (ConfigError when
    nothing fits). `model`: the shape to plan for in place of cfg.model's (init_from's)."""
    # Setting one of PLANNED on the command line, or a mesh size in the accelerate config (its
    # PARALLELISM_CONFIG_* variables), as well is an error.
    both = sorted(name for name in PLANNED if name in set_on_cli)
    if both:
        raise ConfigError(
            f"parallel.plan=auto chooses {', '.join(both)}; drop --{' --'.join(both)} or use "
            "parallel.plan=manual"
        )
    # accelerate's parallelism_config sizes reach the run as PARALLELISM_CONFIG_* variables;
    # plan auto would overrule them, so they are refused exactly as the command-line flags are.
    launched = launched_mesh_env()
    if launched:
        settings = ", ".join(
            f"parallelism_config_{env.removeprefix('PARALLELISM_CONFIG_').lower()}={value}"
            for env, value in launched.items()
        )
        names = ", ".join(f"parallel.{LAUNCHER_MESH_ENV[env]}" for env in launched)
        raise ConfigError(
            f"parallel.plan=auto chooses {names}, but accelerate's launch sets them ({settings}: "
            "the config's parallelism_config, the sizes it leaves out as 1); drop "
            "parallelism_config from the accelerate config or use parallel.plan=manual"
        )
    best = best_plan(
        cfg, world, min(per_node, world), hw, model=model, documents=packed_documents(cfg)
    )
    choices = {
        "dp_replicate": best.dp_replicate,
        "dp_shard": best.dp_shard,
        "tp": best.tp,
        "activation_checkpoint": best.activation_checkpoint,
        "micro_batch": best.micro_batch,
    }
    line = (
        f"plan auto ({hw.name}): dp_replicate={best.dp_replicate} x dp_shard={best.dp_shard} x "
        f"tp={best.tp}, {best.activation_checkpoint} checkpointing, micro batch "
        f"{best.micro_batch}"
    )
    return choices, line
