"""Hugging Face checkpoints of the supported families (Llama, Mistral, Qwen2, Qwen3, Gemma 3
text): config.json <-> ModelConfig, and loading weights at start-up.

`--checkpoint.init_from hf:PATH` reads a HF model directory straight into the sharded model:
every rank reads only the bytes of its own shard of each parameter (a TP x FSDP shard is one
rectangular block of the full tensor), so no rank ever holds the full model.
`--checkpoint.init_from dcp:PATH` loads the "model" entry, {<HF parameter name>: tensor}, of a
DCP checkpoint (one written by tools/convert_hf_to_dcp.py, or a training checkpoint's step
directory, whose "optimizer" and "trainer" entries are left alone; see dcp.py). With tied
embeddings only `model.embed_tokens.weight` is required.

Every check that can fail runs on every rank before any collective, so a bad checkpoint is one
error line on each rank and no rank waits for the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from hybrid2d.checkpoint.hf_safetensors import CheckpointError, HFCheckpoint, load_json
from hybrid2d.checkpoint.layout import METADATA, resolve_dir
from hybrid2d.checkpoint.reader import (
    expected_model_shapes,
    model_entries,
    model_keys,
    read_metadata,
    read_saved_block,
    saved_tensor,
)
from hybrid2d.checkpoint.safe_metadata import MetadataReader
from hybrid2d.config import JobConfig, ModelConfig, interleaved_layer_types
from hybrid2d.errors import ConfigError
from hybrid2d.parallel.lora import is_adapter
from hybrid2d.paths import init_from_dir, split_init_from

# HF class -> (our family, its config.json model_type). Gemma3ForConditionalGeneration (the
# vision model) and Mixtral-style MoE models are not here: they are refused by name.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Gemma3ForCausalLM": ("gemma3", "gemma3_text"),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ARCHITECTURE_OF = {family: arch for arch, (family, _) in ARCHITECTURES.items()}
# The switches that follow from the family alone (the rest are read from config.json).
FAMILY_SWITCHES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3": {
        "qk_norm": True,
        "norm_plus_one": True,
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "scale_embeddings": True,
    },
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# HF files of some transformers-4 versions carry these buffers; they are recomputed, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# What transformers itself assumes when config.json leaves a key out, where it depends on the
# family (the class's defaults).
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma3": 256}
_DEFAULT_TIED = {"gemma3": True}
_LAYER_TYPES = {"full_attention": "F", "sliding_attention": "S"}

# (ModelConfig field, config.json key) in the order mismatches are reported: shapes first.
FIELD_TO_HF = (
    ("family", "architectures"),
    ("dim", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("ffn_dim", "intermediate_size"),
    ("vocab_size", "vocab_size"),
    ("tie_embeddings", "tie_word_embeddings"),
    ("qkv_bias", "architectures (q/k/v biases)"),
    ("qk_norm", "architectures (q/k norms)"),
    ("norm_plus_one", "architectures ((1 + w) norms)"),
    ("sandwich_norms", "architectures (four norms per block)"),
    ("mlp_activation", "hidden_act"),
    ("scale_embeddings", "architectures (scaled embeddings)"),
    ("norm_eps", "rms_norm_eps"),
    ("attn_scale_base", "query_pre_attn_scalar"),
    ("sliding_window", "sliding_window"),
    ("layer_types", "layer_types"),
    ("rope_theta", "rope_theta"),
    ("rope_local_theta", "rope_parameters.sliding_attention.rope_theta"),
    ("rope_scaling_factor", "rope_scaling.factor"),
    ("rope_scaling_type", "rope_scaling.rope_type"),
    ("rope_low_freq_factor", "rope_scaling.low_freq_factor"),
    ("rope_high_freq_factor", "rope_scaling.high_freq_factor"),
    ("rope_original_max_position", "rope_scaling.original_max_position_embeddings"),
    ("max_position_embeddings", "max_position_embeddings"),
)
_LLAMA3_FIELDS = {
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
}


# ---- config.json <-> ModelConfig -------------------------------------------------------------


def _rope_settings(hf: dict, where: str, layer_type: str = "") -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config.json convention; `layer_type`:
    Gemma 3's RoPE of that kind of layer.

    transformers 5 writes `rope_parameters` (rope_theta inside; Gemma 3: one such dict per layer
    type); transformers 4 wrote top-level `rope_theta` and `rope_scaling` (with `rope_type`, or
    `type` in older files), and Gemma 3 its local layers' base as `rope_local_base_freq`.
    """
    params = hf.get("rope_parameters")
    if layer_type:
        if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
            own = params[layer_type]
            return _rope_of(own, own.get("rope_theta"), f"rope_parameters.{layer_type}", where)
        if layer_type == "sliding_attention":
            return float(hf.get("rope_local_base_freq", 10000.0)), None
        return _rope_of(hf.get("rope_scaling"), hf.get("rope_theta", 1e6), "rope_scaling", where)
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta"))
        return _rope_of(params, theta, "rope_parameters", where)
    return _rope_of(hf.get("rope_scaling"), hf.get("rope_theta"), "rope_scaling", where)


def _rope_of(scaling: dict | None, theta, key: str, where: str) -> tuple[float, dict | None]:
    theta = 10000.0 if theta is None else float(theta)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: {key} rope type {kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise CheckpointError(
            f"{where}: {key}.partial_rotary_factor={partial} is not supported; hybrid2d rotates "
            "the whole head (1.0)"
        )
    return theta, (scaling if kind != "default" else None)


def _refuse_unless(hf: dict, where: str, arch: str, key: str, supported, default=None) -> None:
    """A config.json value the model would otherwise silently ignore is an error naming it."""
    value = hf.get(key, supported if default is None else default)
    if value != supported:
        raise CheckpointError(
            f"{where}: {key}={value!r} is not supported for {arch}; hybrid2d needs {supported!r}"
        )


def _architecture(hf: dict, where: str) -> str:
    """The one supported HF class config.json names (by `architectures`, else `model_type`)."""
    archs = hf.get("architectures") or []
    if not archs:
        by_type = {model_type: a for a, (_, model_type) in ARCHITECTURES.items()}
        if hf.get("model_type") in by_type:
            archs = [by_type[hf["model_type"]]]
    unsupported = [a for a in archs if a not in ARCHITECTURES]
    if unsupported or len(archs) != 1:
        name = unsupported[0] if unsupported else f"model_type={hf.get('model_type')!r}"
        raise CheckpointError(
            f"{where}: unsupported architecture {name}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    model_type = ARCHITECTURES[arch][1]
    if hf.get("model_type", model_type) != model_type:
        raise CheckpointError(
            f"{where}: model_type={hf['model_type']!r} does not match architectures {arch} "
            f"(which has model_type {model_type!r})"
        )
    return arch


def _windows(hf: dict, where: str, family: str, n_layers: int) -> tuple[int, str]:
    """(sliding_window, layer_types) of config.json, in ModelConfig's canonical form: window 0
    when no layer slides, layer_types "" when every layer is of one kind."""
    if family == "llama":
        return 0, ""  # LlamaForCausalLM has no sliding window (HF ignores the keys too)
    window = hf.get("sliding_window")
    if family == "mistral":
        if hf.get("layer_types") is not None:
            raise CheckpointError(
                f"{where}: layer_types is not read by MistralForCausalLM (transformers ignores "
                "it); remove it, or convert the model to a class that alternates layer types"
            )
        return int(window or 0), ""
    if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window
    names = hf.get("layer_types")
    if names is None:
        if family == "gemma3":
            pattern = int(hf.get("sliding_window_pattern", 6))
            names = [
                "sliding_attention" if kind == "S" else "full_attention"
                for kind in interleaved_layer_types(n_layers, pattern)
            ]
        else:
            first = int(hf.get("max_window_layers", 28))
            names = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(n_layers)
            ]
    bad = [n for n in names if n not in _LAYER_TYPES]
    if bad or len(names) != n_layers:
        raise CheckpointError(
            f"{where}: layer_types={names!r} must name each of the {n_layers} layers "
            f"{' or '.join(_LAYER_TYPES)}"
        )
    types = "".join(_LAYER_TYPES[n] for n in names)
    if "S" not in types:
        return 0, ""
    if not window:
        what = "use_sliding_window is false" if family != "gemma3" else f"sliding_window={window}"
        raise CheckpointError(
            f"{where}: layer_types has sliding_attention layers but {what}; give the window"
        )
    return int(window), "" if set(types) == {"S"} else types


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig for a config.json of a supported architecture; anything it cannot represent
    (another architecture, a setting the model would ignore) raises, naming it."""
    arch = _architecture(hf, where)
    family = ARCHITECTURES[arch][0]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        if not isinstance(hf.get(key), int):
            raise CheckpointError(f"{where}: {key} is missing or not an integer")
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(
            f"{where}: quantization_config is set (quant_method {method!r}); hybrid2d loads and "
            "trains unquantized weights: use the model's unquantized checkpoint"
        )
    if family == "gemma3":
        _refuse_unless(hf, where, arch, "hidden_activation", "gelu_pytorch_tanh")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise CheckpointError(
                    f"{where}: {key}={hf[key]!r} is not supported for {arch}; hybrid2d needs "
                    "null (no softcapping)"
                )
        _refuse_unless(hf, where, arch, "use_bidirectional_attention", False)
    else:
        _refuse_unless(hf, where, arch, "hidden_act", "silu")
    if family != "qwen2":  # Qwen2's q/k/v always have biases, whatever attention_bias says
        _refuse_unless(hf, where, arch, "attention_bias", False)
    _refuse_unless(hf, where, arch, "mlp_bias", False)
    _refuse_unless(hf, where, arch, "attention_dropout", 0.0)
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(family)
    if head_dim is None:
        if dim % heads:
            raise CheckpointError(
                f"{where}: hidden_size={dim} is not divisible by num_attention_heads={heads} "
                "and head_dim is not given"
            )
        head_dim = dim // heads
    n_layers = hf["num_hidden_layers"]
    window, layer_types = _windows(hf, where, family, n_layers)
    if family == "gemma3":
        theta, scaling = _rope_settings(hf, where, "full_attention")
        local_theta, local_scaling = _rope_settings(hf, where, "sliding_attention")
        if local_scaling is not None:
            raise CheckpointError(
                f"{where}: rope_parameters.sliding_attention rope type "
                f"{local_scaling.get('rope_type')!r} is not supported; the local layers take "
                "'default'"
            )
    else:
        (theta, scaling), local_theta = _rope_settings(hf, where), 0.0
    cfg = ModelConfig(
        name=family,
        family=family,
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        attn_head_dim=0 if dim == heads * head_dim else head_dim,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_local_theta=local_theta,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", _DEFAULT_TIED.get(family, False))),
        sliding_window=window,
        layer_types=layer_types,
        attn_scale_base=float(hf.get("query_pre_attn_scalar", 256)) if family == "gemma3" else 0.0,
        **FAMILY_SWITCHES[family],
    )
    if scaling is not None:
        cfg.rope_scaling_type = scaling.get("rope_type", scaling.get("type"))
        try:
            cfg.rope_scaling_factor = float(scaling["factor"])
            if cfg.rope_scaling_type == "llama3":
                cfg.rope_low_freq_factor = float(scaling["low_freq_factor"])
                cfg.rope_high_freq_factor = float(scaling["high_freq_factor"])
                cfg.rope_original_max_position = int(scaling["original_max_position_embeddings"])
        except KeyError as e:
            raise CheckpointError(
                f"{where}: {cfg.rope_scaling_type} rope scaling lacks {e.args[0]}"
            ) from None
    if heads % cfg.n_kv_heads:
        raise CheckpointError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads="
            f"{cfg.n_kv_heads}"
        )
    return cfg


def _rope_dict(cfg: ModelConfig) -> dict:
    """transformers 5's rope_parameters of the global layers."""
    if not cfg.rope_scaling_factor:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope = {
        "rope_type": cfg.rope_scaling_type,
        "rope_theta": cfg.rope_theta,
        "factor": cfg.rope_scaling_factor,
    }
    if cfg.rope_scaling_type == "llama3":
        rope |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
        }
    return rope


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A config.json transformers loads as the family's class (`AutoModelForCausalLM`), holding
    every setting the model reads. Llama's RoPE is written the transformers-4 way (top-level
    rope_theta / rope_scaling), which transformers 4 and 5 both read; the other families' the
    transformers-5 way (`rope_parameters`)."""
    arch = ARCHITECTURE_OF[cfg.family]
    hf = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch][1],
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    types = [
        "sliding_attention" if cfg.layer_window(i) else "full_attention"
        for i in range(cfg.n_layers)
    ]
    window = cfg.sliding_window or None
    if cfg.family == "llama":
        rope = _rope_dict(cfg)
        hf["rope_theta"] = rope.pop("rope_theta")
        hf["rope_scaling"] = rope if cfg.rope_scaling_factor else None
        return hf | {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    if cfg.family == "mistral":
        return (
            hf
            | {"hidden_act": "silu", "rope_parameters": _rope_dict(cfg)}
            | {"sliding_window": window}
        )
    if cfg.family in ("qwen2", "qwen3"):
        hf |= {
            "hidden_act": "silu",
            "rope_parameters": _rope_dict(cfg),
            "use_sliding_window": window is not None,
            "sliding_window": window,
            # transformers reads layer_types; max_window_layers says the same where it can.
            "max_window_layers": types.index("sliding_attention") if window else cfg.n_layers,
            "layer_types": types,
        }
        return hf | ({"attention_bias": False} if cfg.family == "qwen3" else {})
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return hf | {  # gemma3
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {"full_attention": _rope_dict(cfg), "sliding_attention": local},
        # transformers types it int (a published value always is)
        "query_pre_attn_scalar": _int_if_whole(cfg.attn_scale_base or cfg.head_dim),
        "sliding_window": window,
        "layer_types": types,
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def config_mismatch(ckpt: ModelConfig, model: ModelConfig) -> tuple[str, str, object, object]:
    """The first (field, config.json key, checkpoint value, model value) that differs, or ()."""
    for name, hf_key in FIELD_TO_HF:
        if name in _LLAMA3_FIELDS and ckpt.rope_scaling_type != "llama3":
            continue
        if name in _LLAMA3_FIELDS | {"rope_scaling_type"} and not ckpt.rope_scaling_factor:
            continue
        a, b = getattr(ckpt, name), getattr(model, name)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            return name, hf_key, a, b
    return ()


def check_model_config(ckpt: ModelConfig, model: ModelConfig, source: str, what: str) -> None:
    bad = config_mismatch(ckpt, model)
    if bad:
        name, hf_key, a, b = bad
        setting = "attn_head_dim" if name == "head_dim" else name  # the property's setting
        raise CheckpointError(
            f"checkpoint.init_from={source}: {what} {hf_key}={a} but model.{name}={b}; set "
            f"--model.{setting} {a} or use a recipe that matches the checkpoint"
        )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for this config, in the model's order. With tied embeddings
    lm_head.weight is left out (it is model.embed_tokens.weight; a checkpoint may hold it)."""
    shapes = expected_model_shapes(cfg)
    if cfg.tie_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def check_tensor_names(
    found: dict[str, tuple[int, ...]], cfg: ModelConfig, where: str, what: str = "config.json"
) -> list[str]:
    """Raise on the first missing, unexpected or mis-shaped tensor of `found` (the checkpoint's
    name -> shape); return the names to copy."""
    want = expected_shapes(cfg)
    for name, shape in want.items():
        if name not in found:
            raise CheckpointError(f"{where}: tensor {name} (shape {list(shape)}) is missing")
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {list(found[name])} but {what} implies "
                f"{list(shape)}"
            )
    for name, shape in found.items():
        tied_head = name == "lm_head.weight" and tuple(shape) == want["model.embed_tokens.weight"]
        if name not in want and not tied_head and not name.endswith(IGNORED_SUFFIXES):
            raise CheckpointError(
                f"{where}: unexpected tensor {name} (shape {list(shape)}) for a "
                f"{ARCHITECTURE_OF[cfg.family]} with this {what}"
            )
    return [name for name in dict.fromkeys([*want, "lm_head.weight"]) if name in found]


# ---- loading into a (sharded) model ----------------------------------------------------------


@dataclass
class LoadReport:
    source: str
    tensors: int = 0
    bytes_read: int = 0  # tensor bytes this rank read from disk (0: dcp.load read them)
    checkpoint_bytes: int = 0  # bytes of the model's tensors in the checkpoint
    seconds: float = 0.0


_last_report: LoadReport | None = None


def last_load_report() -> LoadReport | None:
    """What the most recent load_pretrained call on this process read (for logs and tests)."""
    return _last_report


def parse_init_from(spec: str) -> tuple[str, str]:
    """(kind, the directory to read) of checkpoint.init_from; a malformed value is a
    CheckpointError, which callers that follow recorded init_from values tell apart."""
    try:
        kind, path = split_init_from(spec)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if kind == "dcp" and os.path.isdir(path) and not os.path.isfile(os.path.join(path, METADATA)):
        # A run dir (or its checkpoints/) stands for its latest checkpoint, as for resume.
        path = str(resolve_dir(Path(path), "checkpoint.init_from", spec))
    return kind, path


def local_block(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's piece of a parameter in the full tensor.

    For a DTensor that is the chunk DCP itself saves for it (`__create_chunk_list__`: one
    rectangular block for the layouts TP and FSDP2 produce, FSDP-over-TP's _StridedShard
    included), so a sliced load places bytes exactly where a DCP save takes them from. It is
    checked against the local tensor's shape.
    """
    if not isinstance(param, DTensor):
        return (0,) * param.ndim, tuple(param.shape)
    chunks = param.__create_chunk_list__()
    local = tuple(param.to_local().shape)
    if len(chunks) != 1 or tuple(chunks[0].sizes) != local:
        raise NotImplementedError(
            f"unsupported DTensor layout {param.placements} for sliced loads: chunks "
            f"{[(list(c.offsets), list(c.sizes)) for c in chunks]}, local {list(local)}"
        )
    return tuple(chunks[0].offsets), local


def check_hf_source(ckpt: HFCheckpoint, cfg: ModelConfig, source: str) -> None:
    """Check an open HF dir's config and tensors against cfg."""
    hf_cfg = model_config_from_hf(ckpt.config, os.path.join(ckpt.path, "config.json"))
    check_model_config(hf_cfg, cfg, source, "config.json")
    shapes = {n: t.shape for n, t in ckpt.tensors.items()}
    check_tensor_names(shapes, cfg, f"checkpoint.init_from={source}")


def base_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters a base checkpoint holds: all but LoRA adapters."""
    return [(n, p) for n, p in model.named_parameters() if not is_adapter(n)]


@torch.no_grad()
def _fill_blocks(model: nn.Module, source: str, start: float, checkpoint_bytes: int, read_into):
    """Fill every parameter's local block with read_into(name, offsets, sizes, out), which
    returns the bytes it read from disk, then recompute the buffers."""
    report = LoadReport(source, checkpoint_bytes=checkpoint_bytes)
    for name, param in base_parameters(model):  # tied: only model.embed_tokens.weight
        offsets, sizes = local_block(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        report.bytes_read += read_into(name, offsets, sizes, local)
        report.tensors += 1
    # Buffers are not in checkpoints (HF has none either): the RoPE table is recomputed.
    model.init_buffers()
    report.seconds = time.perf_counter() - start
    return report


def load_hf(model: nn.Module, path: str, source: str | None = None) -> LoadReport:
    """Read a HF directory into `model` (plain or TP/FSDP-sharded), each rank only its blocks."""
    source = source or f"hf:{path}"
    start = time.perf_counter()

    def read_into(name: str, offsets, sizes, out: torch.Tensor) -> int:
        block = ckpt.read_slice(name, offsets, sizes)
        out.copy_(block)
        return block.numel() * block.element_size()

    with HFCheckpoint(path) as ckpt:
        check_hf_source(ckpt, model.cfg, source)
        total = sum(ckpt.tensors[name].nbytes for name, _ in base_parameters(model))
        return _fill_blocks(model, source, start, total, read_into)


# ---- DCP ("model" entry only) ----------------------------------------------------------------


def read_saved_model_config(path: str) -> ModelConfig | None:
    """The model section of a DCP directory's config.json (hybrid2d JobConfig), or None."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    data = load_json(cfg_path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return None
    return JobConfig.from_dict({"model": data["model"]}).model


def check_dcp_source(
    path: str, cfg: ModelConfig, source: str
) -> tuple[Metadata, dict[str, TensorStorageMetadata]]:
    where = f"checkpoint.init_from={source}"
    meta = read_metadata(Path(path))
    found = model_entries(meta, path)
    saved = read_saved_model_config(path)
    if saved is not None:
        check_model_config(saved, cfg, source, "config.json model")
    check_tensor_names({n: tuple(t.size) for n, t in found.items()}, cfg, where, "the model")
    return meta, found


@torch.no_grad()
def load_dcp(model: nn.Module, path: str, source: str | None = None) -> LoadReport:
    """Load the "model" entry of a DCP checkpoint into `model`; other entries are not read.

    Each rank reads only the bytes of its own block of each parameter: for every saved chunk
    that overlaps the block, the chunk's torch.save archive is located through DCP's metadata
    and just the overlapping rows are read (reader.read_saved_block). No collective runs, so
    checkpoints written with storage transforms (compression) are the only ones loaded through
    dcp.load, which reads whole chunks.
    """
    source = source or f"dcp:{path}"
    start = time.perf_counter()
    md, entries = check_dcp_source(path, model.cfg, source)
    params = dict(base_parameters(model))  # tied: only model.embed_tokens.weight
    total = sum(math.prod(entries[n].size) * entries[n].properties.dtype.itemsize for n in params)
    if any(info.transform_descriptors for info in md.storage_data.values()):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single"
            )
            no_dist = not (dist.is_available() and dist.is_initialized())
            dcp.load({"model": params}, storage_reader=MetadataReader(path), no_dist=no_dist)
        return _fill_blocks(model, source, start, total, lambda *_: 0)  # dcp.load filled them
    keys = model_keys(md)
    storage = {  # non-tensor entries (a training checkpoint's lr, ...) have no offset
        (i.fqn, tuple(i.offset)): info
        for i, info in md.storage_data.items()
        if i.offset is not None
    }
    files = {}

    def read_into(name: str, offsets, sizes, out: torch.Tensor) -> int:
        read = 0
        for chunk in entries[name].chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            hi = [
                min(o + s, c + n)
                for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            info = storage[(keys[name], tuple(chunk.offsets))]
            f = files.get(info.relative_path)
            if f is None:
                f = files[info.relative_path] = stack.enter_context(
                    open(os.path.join(path, info.relative_path), "rb", buffering=0)
                )
            where = f"checkpoint.init_from={source}: {name} in {info.relative_path}"
            at, saved = saved_tensor(f, info.offset, info.length, where)
            if tuple(saved.shape) != tuple(chunk.sizes):
                raise CheckpointError(
                    f"{where}: stored shape {list(saved.shape)} differs from the metadata's "
                    f"{list(chunk.sizes)} (corrupted checkpoint)"
                )
            within = [low - c for low, c in zip(lo, chunk.offsets, strict=True)]
            extent = [h - low for low, h in zip(lo, hi, strict=True)]
            block, n = read_saved_block(f, at, saved, within, extent, where)
            dest = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets, strict=True))
            out[dest].copy_(block)
            read += n
        return read

    with contextlib.ExitStack() as stack:
        return _fill_blocks(model, source, start, total, read_into)


def load_pretrained(model: nn.Module, spec: str) -> LoadReport:
    """`checkpoint.init_from` for a model whose shards are allocated (after to_empty): fills
    every parameter and recomputes the buffers. Raises CheckpointError (one line) on any
    mismatch, on every rank, before any collective."""
    global _last_report
    kind, path = parse_init_from(spec)
    report = load_hf(model, path, spec) if kind == "hf" else load_dcp(model, path, spec)
    _last_report = report
    return report


def describe_load(report: LoadReport) -> str:
    mib = 2**20
    if report.bytes_read:
        share = report.bytes_read / max(report.checkpoint_bytes, 1)
        read = (
            f"rank 0 read {report.bytes_read / mib:.1f} MiB of {report.checkpoint_bytes / mib:.1f}"
            f" MiB ({share:.0%})"
        )
    else:
        read = f"{report.checkpoint_bytes / mib:.1f} MiB of parameters"
    return f"init_from {report.source}: {report.tensors} tensors, {read} in {report.seconds:.1f} s"


def source_model(
    cfg: JobConfig, set_on_cli: set[str] | frozenset[str]
) -> tuple[ModelConfig | None, str]:
    """With checkpoint.init_from: (the model shape to train, the tokenizer to use).

    The shape is the checkpoint's (a user starting from a published model need not restate
    it; None when the checkpoint records none, and the tensor-by-tensor check at load time
    still applies); the --model.* settings given on the command line must agree with it,
    which is checked here, on every rank, before any process group or data work. The
    tokenizer is data.tokenizer, else the tokenizer.json stored with the checkpoint (a HF
    directory, a converted directory, a training checkpoint); a checkpoint without one and no
    data.tokenizer is an error, since a newly trained tokenizer's ids mean nothing to it.
    Nothing in cfg is changed: the caller puts both into the run's layout.
    """
    try:
        return _source_model(cfg, set_on_cli)
    except ConfigError as e:  # name the setting the user gave, once
        if "checkpoint.init_from" in str(e):
            raise
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from}: {e}") from None


def _source_model(
    cfg: JobConfig, set_on_cli: set[str] | frozenset[str]
) -> tuple[ModelConfig | None, str]:
    init_from_dir(cfg.checkpoint.init_from)  # checked before torch loads too (launcher.py)
    kind, path = parse_init_from(cfg.checkpoint.init_from)
    if kind == "hf":
        with HFCheckpoint(path) as ckpt:
            found = model_config_from_hf(ckpt.config, os.path.join(path, "config.json"))
    else:
        meta = read_metadata(Path(path))  # damaged: named before --model.* is compared with it
        found = read_saved_model_config(path)
        if found is None:
            model_entries(meta, path)  # not a DCP checkpoint: says so
    tokenizer = source_tokenizer(cfg, path)
    if found is None:
        return None, tokenizer
    # The settings given on the command line must agree with the checkpoint; every other field
    # is the checkpoint's (the recipe's shape would name a setting the user never gave).
    given = {n.removeprefix("model.") for n in set_on_cli if n.startswith("model.")}
    given.add("init_std")  # not part of a checkpoint's shape
    model = dataclasses.replace(found, **{n: getattr(cfg.model, n) for n in given})
    check_model_config(found, model, cfg.checkpoint.init_from, "its config")
    return model, tokenizer


def source_tokenizer(cfg: JobConfig, path: str) -> str:
    """data.tokenizer, else the checkpoint directory when it holds a tokenizer.json."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    raise CheckpointError(
        f"checkpoint.init_from={cfg.checkpoint.init_from} holds no tokenizer.json and "
        "data.tokenizer is empty, which would train a new tokenizer whose ids mean nothing to "
        "the checkpoint; set --data.tokenizer to the tokenizer the checkpoint was trained with"
    )
