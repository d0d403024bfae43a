"""The recipe registry: a name -> a complete JobConfig, with what hardware it expects.

Shapes of the published models follow their HF config.json files. The parallel defaults of the
GPU recipes (mesh, activation checkpointing, micro batch) are the planner's best plan for the
hardware each names (`python tools/plan.py --recipe NAME --nodes N --gpus-per-node G --gpu GPU
--gpu-memory MEM`); tests/test_recipes.py checks that each still fits and is still the best.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """What a recipe expects: `nodes` x `gpus_per_node` devices of a planner profile (`gpu`)
    with `memory` each (a size: 80GB = 80e9 bytes); gpu "cpu" for the CPU recipe."""

    nodes: int
    gpus_per_node: int
    gpu: str
    memory: str = ""

    def __str__(self) -> str:
        if self.gpu == "cpu":
            return "any CPU (4 processes on 2 cores: ~1 min)"
        gpus = f"{self.gpus_per_node} GPU" + ("s" if self.gpus_per_node > 1 else "")
        where = f"{self.nodes} nodes x {gpus}" if self.nodes > 1 else gpus
        return f"{where} with {self.memory} ({self.gpu} class)"


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[], JobConfig]
    hardware: Hardware
    description: str


_REGISTRY: dict[str, Recipe] = {}


def register(name: str, hardware: Hardware, description: str):
    """Decorator: register a function returning a JobConfig under `name`."""

    def wrap(fn: Callable[[], JobConfig]) -> Callable[[], JobConfig]:
        if name in _REGISTRY:
            raise ValueError(f"recipe {name!r} is already registered")
        _REGISTRY[name] = Recipe(name, fn, hardware, description)
        return fn

    return wrap


def get(name: str) -> JobConfig:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(_REGISTRY)}"
        raise ConfigError(f"unknown recipe {name!r}; {hint} (list them with --list)")
    cfg = _REGISTRY[name].build()
    cfg.recipe = name
    return cfg


def names() -> list[str]:
    return list(_REGISTRY)


def describe(name: str) -> Recipe:
    return _REGISTRY[name]


def mesh_text(cfg: JobConfig) -> str:
    p = cfg.parallel
    shard = "auto" if p.dp_shard == -1 else str(p.dp_shard)
    rep = f"dp_replicate={p.dp_replicate} x " if p.dp_replicate > 1 else ""
    extra = (
        f", {p.activation_checkpoint} checkpointing" if p.activation_checkpoint != "none" else ""
    )
    micro = f", micro batch {cfg.train.micro_batch}" if cfg.train.micro_batch else ""
    return f"{rep}dp_shard={shard} x tp={p.tp}{extra}{micro}"


def table() -> str:
    """One line per recipe: name, parameters, default mesh, hardware."""
    rows = [("recipe", "params", "default mesh", "expects")]
    for name in _REGISTRY:
        cfg = get(name)
        n = cfg.model.num_params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        rows.append((name, size, mesh_text(cfg), str(_REGISTRY[name].hardware)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        for r in rows
    )


# ---- the recipes -----------------------------------------------------------------------------

_LLAMA3_VOCAB = 128256


def _llama3(dim, layers, heads, ffn, rope_factor, tie, max_pos=131072) -> ModelConfig:
    return ModelConfig(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=8,
        ffn_dim=ffn,
        vocab_size=_LLAMA3_VOCAB,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling_factor=rope_factor,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=8192,
        max_position_embeddings=max_pos,
        tie_embeddings=tie,
    )


@register(
    "llama-debug",
    Hardware(1, 4, "cpu"),
    "tiny Llama trained on the Python stdlib sources; the CPU default",
)
def _debug() -> JobConfig:
    cfg = JobConfig()
    cfg.model = ModelConfig(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=688,
        vocab_size=4096,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    )
    cfg.train.steps = 150
    return cfg


def _large(
    model: ModelConfig, seq_len: int, global_batch: int, tp: int, ac: str, micro: int
) -> JobConfig:
    cfg = JobConfig(model=model)
    cfg.parallel.tp, cfg.parallel.activation_checkpoint = tp, ac  # dp_shard: what tp leaves
    t = cfg.train
    t.seq_len, t.global_batch, t.micro_batch, t.steps = seq_len, global_batch, micro, 1000
    t.lr, t.warmup_steps, t.min_lr_ratio = 3e-4, 100, 0.1
    cfg.data.max_chars = 0
    cfg.checkpoint.every = 500
    return cfg


# Planned on 2026-12-03 (tools/plan.py): 1B on one 80 GB GPU, 2.47 s/step, 44.2 GiB predicted;
# the states alone (fp32 weights, gradients, AdamW: 16 bytes per parameter) need 18.5 GiB.
@register("llama3.2-1b", Hardware(1, 1, "h100", "80GB"), "Llama 3.2 1B, tied embeddings")
def _llama32_1b() -> JobConfig:
    model = _llama3(2048, 16, 32, 8192, 32.0, tie=True)
    return _large(model, seq_len=2048, global_batch=64, tp=1, ac="none", micro=4)


# 8B on 8 x 80 GB: dp_shard 4 x tp 2, micro batch 2, no checkpointing: 3.56 s/step, 50.6 GiB.
@register("llama3.1-8b", Hardware(1, 8, "h100", "80GB"), "Llama 3.1 8B")
def _llama31_8b() -> JobConfig:
    model = _llama3(4096, 32, 32, 14336, 8.0, tie=False)
    return _large(model, seq_len=4096, global_batch=64, tp=2, ac="none", micro=2)


# 70B on 8 x 8 x 80 GB: dp_shard 32 x tp 2, selective checkpointing, micro batch 1: 17.9 s/step,
# 62.9 GiB (eager, planned 2026-12-05). FSDP over all 64 with full checkpointing at micro batch 4
# is within 1% (18.1 s): tp's exposed collectives weigh less against eager compute.
@register("llama3.1-70b", Hardware(8, 8, "h100", "80GB"), "Llama 3.1 70B")
def _llama31_70b() -> JobConfig:
    model = _llama3(8192, 80, 64, 28672, 8.0, tie=False)
    return _large(model, seq_len=4096, global_batch=256, tp=2, ac="selective", micro=1)
