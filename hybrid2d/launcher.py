"""What the launcher (torchrun, accelerate launch) tells a process: its rank, the world, and the
mesh sizes of an accelerate config. Plain Python, so the recipe can check every setting against
the world before torch is imported (a mistyped size fails in 0.3 s, not 4 s)."""

from __future__ import annotations

import os

from hybrid2d.config import ConfigError, JobConfig

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


def _launcher_sizes(set_on_cli: set[str]) -> list[tuple[str, str, str]]:
    """(variable, parallel field, value) of each mesh size accelerate's launch settings give and
    the command line does not."""
    return [
        (env, name, os.environ[env])
        for env, name in LAUNCHER_MESH_ENV.items()
        if os.environ.get(env) and f"parallel.{name}" not in set_on_cli
    ]


def apply_launcher_settings(cfg: JobConfig, set_on_cli: set[str]) -> None:
    """Take mesh sizes from accelerate's launch settings unless the command line set them."""
    for env, name, value in _launcher_sizes(set_on_cli):
        try:
            setattr(cfg.parallel, name, int(value))
        except ValueError:
            raise ConfigError(f"{env}={value!r} is not an integer") from None


def launcher_sizes_note(set_on_cli: set[str]) -> str:
    """'; parallel.dp_shard=2 came from the launcher (PARALLELISM_CONFIG_DP_SHARD_SIZE)', for
    the mesh sizes apply_launcher_settings took, to end an error about the mesh; '' if none."""
    taken = [
        f"parallel.{name}={value} came from the launcher ({env})"
        for env, name, value in _launcher_sizes(set_on_cli)
    ]
    return "; " + ", ".join(taken) if taken else ""


def validate_for_world(cfg: JobConfig, set_on_cli: set[str]) -> tuple[int, int, int]:
    """cfg.validate over the launched world: (dp_replicate, dp_shard, tp). An error about the
    mesh names the sizes the launcher gave, which the user never typed."""
    try:
        return cfg.validate(world_from_env()[1])
    except ConfigError as e:
        raise ConfigError(f"{e}{launcher_sizes_note(set_on_cli)}") from None


def check_before_torch(cfg: JobConfig, set_on_cli: set[str]) -> None:
    """Every setting checked against the world, unless the run decides some later: the
    planner's mesh (parallel.plan auto) or the model's shape from checkpoint.init_from."""
    apply_launcher_settings(cfg, set_on_cli)
    if cfg.parallel.plan != "auto" and not cfg.checkpoint.init_from:
        validate_for_world(cfg, set_on_cli)
