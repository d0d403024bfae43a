"""The planner at the start of a run: the profile of the machine it launched on, the prediction
for the launched configuration, and `parallel.plan=auto` (take the best plan for this world)."""

from __future__ import annotations

import torch

from hybrid2d.config import ConfigError, JobConfig, ModelConfig
from hybrid2d.launcher import LAUNCHER_MESH_ENV, launched_mesh_env
from hybrid2d.layout import RunLayout
from hybrid2d.planner import hardware as profiles
from hybrid2d.planner.hardware import Hardware
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


def guess_note(hw: Hardware) -> str:
    """Why the profile's figures are only a guess for this machine, with the way to measure
    them; "" for a preset or a calibrated profile."""
    if hw.name == "cpu" or hw.description.endswith("a guess"):
        return (
            f"{hw.description}; measure this machine with tools/plan.py --calibrate "
            f"--device {hw.target} --out FILE.json, then --parallel.plan_hardware FILE.json"
        )
    return ""


def prediction(cfg: JobConfig, layout: RunLayout, hw: Hardware, per_node: int) -> Candidate:
    """The planner's figures for exactly this layout."""
    return predict(cfg, layout, hw, gpus_per_node=max(per_node, layout.tp))


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
    best = best_plan(cfg, world, min(per_node, world), hw, model=model)
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
