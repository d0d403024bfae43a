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

from hybrid2d.config import JobConfig, LoraConfig, ModelConfig, interleaved_layer_types
from hybrid2d.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """What a recipe expects: `nodes` x `gpus_per_node` devices of a planner profile (`gpu`)
    with `memory` each (a size: 80GB = 80e9 bytes); gpu "cpu" for the CPU recipe."""

    nodes: int
    gpus_per_node: int
    gpu: str
    memory: str = ""

    def devices(self) -> str:
        gpus = f"{self.gpus_per_node} GPU" + ("s" if self.gpus_per_node > 1 else "")
        return f"{self.nodes} nodes x {gpus}" if self.nodes > 1 else gpus

    def __str__(self) -> str:
        if self.gpu == "cpu":
            return "any CPU (4 processes on 2 cores: ~1 min)"
        return f"{self.devices()} with {self.memory} ({self.gpu} class)"


# What a recipe's LoRA hint assumes: rank-16 adapters on every linear layer of a block, the base
# frozen in bf16 (`--lora.rank 16 --lora.alpha 32 --lora.base_dtype bf16`). The hint is the
# fewest devices of the recipe's kind on which the planner finds a plan that fits
# (tests/test_recipes.py checks that it fits and that half as many do not).
LORA_HINT = LoraConfig(rank=16, alpha=32.0, base_dtype="bf16")


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[], JobConfig]
    hardware: Hardware
    description: str
    lora: Hardware | None = None  # the fewest devices a LORA_HINT run fits on


_REGISTRY: dict[str, Recipe] = {}


def register(name: str, hardware: Hardware, description: str, lora: Hardware | None = None):
    """Decorator: register a function returning a JobConfig under `name`."""

    def wrap(fn: Callable[[], JobConfig]) -> Callable[[], JobConfig]:
        if name in _REGISTRY:
            raise ValueError(f"recipe {name!r} is already registered")
        _REGISTRY[name] = Recipe(name, fn, hardware, description, lora)
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
    """One line per recipe: name, parameters, default mesh, hardware (and LoRA's)."""
    rows = [("recipe", "params", "default mesh", "expects")]
    for name in _REGISTRY:
        cfg = get(name)
        n = cfg.model.num_params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        recipe = _REGISTRY[name]
        expects = str(recipe.hardware)
        if recipe.lora is not None:
            expects += f"; LoRA rank 16, bf16 base: {recipe.lora.devices()}"
        rows.append((name, size, mesh_text(cfg), expects))
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
@register(
    "llama3.2-1b",
    Hardware(1, 1, "h100", "80GB"),
    "Llama 3.2 1B, tied embeddings",
    lora=Hardware(1, 1, "h100", "80GB"),
)
def _llama32_1b() -> JobConfig:
    model = _llama3(2048, 16, 32, 8192, 32.0, tie=True)
    return _large(model, seq_len=2048, global_batch=64, tp=1, ac="none", micro=4)


# 8B on 8 x 80 GB: dp_shard 4 x tp 2, micro batch 2, no checkpointing: 3.56 s/step, 50.6 GiB.
@register(
    "llama3.1-8b",
    Hardware(1, 8, "h100", "80GB"),
    "Llama 3.1 8B",
    lora=Hardware(1, 1, "h100", "80GB"),
)
def _llama31_8b() -> JobConfig:
    model = _llama3(4096, 32, 32, 14336, 8.0, tie=False)
    return _large(model, seq_len=4096, global_batch=64, tp=2, ac="none", micro=2)


# 70B on 8 x 8 x 80 GB: dp_shard 32 x tp 2, selective checkpointing, micro batch 1: 17.9 s/step,
# 62.9 GiB (eager, planned 2026-12-05). FSDP over all 64 with full checkpointing at micro batch 4
# is within 1% (18.1 s): tp's exposed collectives weigh less against eager compute.
@register(
    "llama3.1-70b",
    Hardware(8, 8, "h100", "80GB"),
    "Llama 3.1 70B",
    lora=Hardware(1, 4, "h100", "80GB"),
)
def _llama31_70b() -> JobConfig:
    model = _llama3(8192, 80, 64, 28672, 8.0, tie=False)
    return _large(model, seq_len=4096, global_batch=256, tp=2, ac="selective", micro=1)


# ---- the other families: shapes of each model's published HF config.json ----------------------

_QWEN_VOCAB = 151936


def _qwen3(dim, layers, heads, ffn, tie) -> ModelConfig:
    """Qwen3 (Qwen3ForCausalLM): 8 kv heads of 128 channels whatever the width, q/k norms."""
    return ModelConfig(
        name="qwen3",
        family="qwen3",
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=8,
        attn_head_dim=128,
        qk_norm=True,
        ffn_dim=ffn,
        vocab_size=_QWEN_VOCAB,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_embeddings=tie,
    )


def _gemma3(dim, layers, heads, kv_heads, head_dim, ffn, vocab, window, scalar, **rest):
    """Gemma 3 text (Gemma3ForCausalLM): 5 sliding-window layers to 1 global, local RoPE base
    10k, (1 + w) norms before and after attention and MLP, GELU-tanh, tied embeddings."""
    return ModelConfig(
        name="gemma3",
        family="gemma3",
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        attn_head_dim=head_dim,
        ffn_dim=ffn,
        vocab_size=vocab,
        norm_eps=1e-6,
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        attn_scale_base=float(scalar),
        sliding_window=window,
        layer_types=interleaved_layer_types(layers, 6),
        rope_theta=1000000.0,
        rope_local_theta=10000.0,
        tie_embeddings=True,
        **rest,
    )


# The defaults below are each recipe's best plan on its hardware (tools/plan.py, 2026-12-07):
# qwen3-0.6b 6.73 s/step, 38.5 GiB; gemma3-1b 7.00 s, 61.9 GiB (the 262k vocabulary's logits);
# qwen3-8b 4.73 s, 55.5 GiB; qwen2.5-7b 3.81 s, 48.1 GiB (2x2x2 is 0.5% slower); mistral-7b
# 3.76 s, 66.7 GiB; qwen3-32b 19.6 s, 65.9 GiB (1x8x2 is 0.3% slower); gemma3-27b 16.9 s,
# 55.0 GiB. Mistral 7B v0.3 has no sliding window (v0.1's was 4096, the sequence length here).
@register(
    "qwen3-0.6b",
    Hardware(1, 1, "h100", "80GB"),
    "Qwen3 0.6B, tied embeddings",
    lora=Hardware(1, 1, "h100", "80GB"),
)
def _qwen3_06b() -> JobConfig:
    model = _qwen3(1024, 28, 16, 3072, tie=True)
    return _large(model, seq_len=4096, global_batch=64, tp=1, ac="none", micro=2)


@register(
    "qwen3-8b", Hardware(1, 8, "h100", "80GB"), "Qwen3 8B", lora=Hardware(1, 1, "h100", "80GB")
)
def _qwen3_8b() -> JobConfig:
    model = _qwen3(4096, 36, 32, 12288, tie=False)
    return _large(model, seq_len=4096, global_batch=64, tp=2, ac="none", micro=2)


@register(
    "qwen3-32b", Hardware(2, 8, "h100", "80GB"), "Qwen3 32B", lora=Hardware(1, 2, "h100", "80GB")
)
def _qwen3_32b() -> JobConfig:
    model = _qwen3(5120, 64, 64, 25600, tie=False)
    return _large(model, seq_len=4096, global_batch=128, tp=4, ac="selective", micro=2)


@register(
    "qwen2.5-7b",
    Hardware(1, 8, "h100", "80GB"),
    "Qwen2.5 7B, q/k/v biases",
    lora=Hardware(1, 1, "h100", "80GB"),
)
def _qwen25_7b() -> JobConfig:
    model = ModelConfig(
        name="qwen2",
        family="qwen2",
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        qkv_bias=True,
        ffn_dim=18944,
        vocab_size=152064,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
    )
    return _large(model, seq_len=4096, global_batch=64, tp=2, ac="none", micro=2)


@register(
    "mistral-7b",
    Hardware(1, 8, "h100", "80GB"),
    "Mistral 7B v0.3",
    lora=Hardware(1, 1, "h100", "80GB"),
)
def _mistral_7b() -> JobConfig:
    model = ModelConfig(
        name="mistral",
        family="mistral",
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32768,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
    )
    return _large(model, seq_len=4096, global_batch=64, tp=1, ac="none", micro=2)


@register(
    "gemma3-1b",
    Hardware(1, 1, "h100", "80GB"),
    "Gemma 3 1B (text), 1 kv head",
    lora=Hardware(1, 1, "h100", "80GB"),
)
def _gemma3_1b() -> JobConfig:
    model = _gemma3(1152, 26, 4, 1, 256, 6912, 262144, window=512, scalar=256)
    model.max_position_embeddings = 32768
    return _large(model, seq_len=4096, global_batch=64, tp=1, ac="none", micro=2)


@register(
    "gemma3-27b",
    Hardware(2, 8, "h100", "80GB"),
    "Gemma 3 27B (text)",
    lora=Hardware(1, 2, "h100", "80GB"),
)
def _gemma3_27b() -> JobConfig:
    model = _gemma3(
        5376,
        62,
        32,
        16,
        128,
        21504,
        262208,
        window=1024,
        scalar=168,
        rope_scaling_factor=8.0,
        rope_scaling_type="linear",
        max_position_embeddings=131072,
    )
    return _large(model, seq_len=4096, global_batch=128, tp=2, ac="selective", micro=1)
