"""The one resolution step at the start of a run: settings + world + launcher environment +
`init_from`'s model + `parallel.plan auto` -> the run's `RunLayout`.

Each source may decide part of the layout, in this order of precedence: the command line, then
accelerate's launch settings, then the recipe; `init_from` gives the model's shape (and the
tokenizer) unless the command line sets it; `plan auto` chooses the mesh, checkpointing and
micro batch. The settings object is read, never written: what ran is the layout, and a run's
config.json records `layout.recorded(cfg)`.
"""

from __future__ import annotations

from hybrid2d.checkpoint.hf import source_model
from hybrid2d.config import JobConfig
from hybrid2d.launcher import layout_for_world
from hybrid2d.layout import RunLayout
from hybrid2d.planner.hardware import Hardware
from hybrid2d.planner.launch import auto_plan


def resolve_layout(
    cfg: JobConfig,
    set_on_cli: set[str] | frozenset[str],
    world: int,
    per_node: int,
    hw: Hardware,
) -> tuple[RunLayout, str | None]:
    """(the layout of this launch, the plan-auto line to print or None); a ConfigError naming
    the setting when the sources do not fit together. `set_on_cli`: the settings the command
    line gave (they win over the launcher's sizes and the checkpoint's shape)."""
    source = {}
    if cfg.checkpoint.init_from:  # the model's shape comes from the checkpoint
        model, tokenizer = source_model(cfg, set_on_cli)
        source = {"tokenizer": tokenizer} | ({"model": model} if model is not None else {})
    choices, plan_line = {}, None
    if cfg.parallel.plan == "auto":  # priced for the model that will run
        choices, plan_line = auto_plan(cfg, world, per_node, hw, set_on_cli, source.get("model"))
    return layout_for_world(cfg, set_on_cli, world, **source, **choices), plan_line
