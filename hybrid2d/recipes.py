"""The recipe registry: a name -> a complete JobConfig, with what hardware it expects.

Shapes of the published models follow their HF config.json files.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from hybrid2d.config import ConfigError, JobConfig, ModelConfig


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[], JobConfig]
    hardware: str
    description: str


_REGISTRY: dict[str, Recipe] = {}


def register(name: str, hardware: str, description: str):
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
    return f"{rep}dp_shard={shard} x tp={p.tp}"


def table() -> str:
    """One line per recipe: name, parameters, default mesh, hardware."""
    rows = [("recipe", "params", "default mesh", "expects")]
    for name in _REGISTRY:
        cfg = get(name)
        n = cfg.model.num_params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        rows.append((name, size, mesh_text(cfg), _REGISTRY[name].hardware))
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
    "any CPU (4 processes on 2 cores: ~1 min)",
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


def _large(model: ModelConfig, tp: int, seq_len: int, global_batch: int) -> JobConfig:
    cfg = JobConfig(model=model)
    cfg.parallel.tp = tp
    t = cfg.train
    t.seq_len, t.global_batch, t.steps = seq_len, global_batch, 1000
    t.lr, t.warmup_steps, t.min_lr_ratio = 3e-4, 100, 0.1
    cfg.data.max_chars = 0
    cfg.checkpoint.every = 500
    return cfg


@register("llama3.2-1b", ">= 1 GPU with 24 GB (FSDP only)", "Llama 3.2 1B, tied embeddings")
def _llama32_1b() -> JobConfig:
    return _large(_llama3(2048, 16, 32, 8192, 32.0, tie=True), tp=1, seq_len=2048, global_batch=64)


@register("llama3.1-8b", "1 node x 8 GPUs with 80 GB (tp=8 inside the node)", "Llama 3.1 8B")
def _llama31_8b() -> JobConfig:
    return _large(_llama3(4096, 32, 32, 14336, 8.0, tie=False), tp=8, seq_len=4096, global_batch=64)


@register(
    "llama3.1-70b", "8 nodes x 8 GPUs with 80 GB (tp=8 per node, FSDP across)", "Llama 3.1 70B"
)
def _llama31_70b() -> JobConfig:
    return _large(
        _llama3(8192, 80, 64, 28672, 8.0, tie=False), tp=8, seq_len=4096, global_batch=256
    )
