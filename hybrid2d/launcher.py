"""What the launcher (torchrun, accelerate launch) tells a process: its rank, the world, and the
mesh sizes of an accelerate config. Plain Python, so the recipe can check every setting against
the world, and the files settings name, before torch is imported (a mistyped size or a missing
path fails in 0.3 s, not 4 to 13 s)."""

from __future__ import annotations

import os

from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.paths import (
    data_source,
    init_from_dir,
    plan_hardware_file,
    resume_dir,
    tokenizer_file,
)

# accelerate's --parallelism_config_* flags reach the processes as these variables.
LAUNCHER_MESH_ENV = {
    "PARALLELISM_CONFIG_TP_SIZE": "tp",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "dp_shard",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "dp_replicate",
}


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun/accelerate set them."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def launched_mesh_env() -> dict[str, str]:
    """Each accelerate launch setting of a mesh size that is set: variable -> value."""
    return {env: os.environ[env] for env in LAUNCHER_MESH_ENV if os.environ.get(env)}


def launcher_sizes(set_on_cli: set[str] | frozenset[str]) -> dict[str, int]:
    """The mesh sizes accelerate's launch settings give and the command line does not
    (parallel field -> size): the command line wins over the launcher, the launcher over the
    recipe."""
    sizes = {}
    for env, value in launched_mesh_env().items():
        name = LAUNCHER_MESH_ENV[env]
        if f"parallel.{name}" in set_on_cli:
            continue
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ConfigError(f"{env}={value!r} is not an integer") from None
    return sizes


def launcher_sizes_note(set_on_cli: set[str] | frozenset[str]) -> str:
    """'; parallel.dp_shard=2 came from the launcher (PARALLELISM_CONFIG_DP_SHARD_SIZE)', for
    the mesh sizes launcher_sizes gives, to end an error about the mesh; '' if none."""
    taken = [
        f"parallel.{LAUNCHER_MESH_ENV[env]}={value} came from the launcher ({env})"
        for env, value in launched_mesh_env().items()
        if f"parallel.{LAUNCHER_MESH_ENV[env]}" not in set_on_cli
    ]
    return "; " + ", ".join(taken) if taken else ""


def layout_for_world(
    cfg: JobConfig, set_on_cli: set[str] | frozenset[str], world: int | None = None, **choices
) -> RunLayout:
    """cfg laid out on the launched world with the launcher's mesh sizes (and `choices`, as
    RunLayout.build takes them). An error about the mesh names the sizes the launcher gave,
    which the user never typed."""
    world = world_from_env()[1] if world is None else world
    try:
        return RunLayout.build(cfg, world, **(launcher_sizes(set_on_cli) | choices))
    except ConfigError as e:
        raise ConfigError(f"{e}{launcher_sizes_note(set_on_cli)}") from None


def check_before_torch(cfg: JobConfig, set_on_cli: set[str] | frozenset[str]) -> None:
    """Every setting checked against the world, unless the run decides some later: the
    planner's mesh (parallel.plan auto) or the model's shape from checkpoint.init_from; and
    every file a setting names, as far as the file system alone tells (hybrid2d/paths.py), in
    the order the run meets them."""
    plan_hardware_file(cfg.parallel.plan_hardware)
    if cfg.checkpoint.init_from:
        init_from_dir(cfg.checkpoint.init_from)
    launcher_sizes(set_on_cli)  # a size that is no integer fails here too
    if cfg.parallel.plan != "auto" and not cfg.checkpoint.init_from:
        layout_for_world(cfg, set_on_cli)
    if cfg.checkpoint.resume not in ("", "auto"):
        resume_dir(cfg.checkpoint.resume)
    for value, setting in ((cfg.data.path, "data.path"), (cfg.data.val_path, "data.val_path")):
        if value:
            data_source(value, setting)
    if cfg.data.tokenizer:
        tokenizer_file(cfg.data.tokenizer)
