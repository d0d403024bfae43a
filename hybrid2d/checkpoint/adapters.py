"""LoRA adapters on disk: what a LoRA training checkpoint holds and must match, and PEFT's
adapter format (`adapter_model.safetensors` + `adapter_config.json`) written from it.

A LoRA training checkpoint holds the adapters, the optimizer's state of them and the trainer's
progress, not the frozen base (it would double the checkpoint for nothing). Its config.json
records where the base came from (`checkpoint.init_from`, or the seeded init: `train.seed`) and
its dtype; a resume must name the same base, or the adapters would sit on other weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hybrid2d.checkpoint.hf import parse_init_from
from hybrid2d.checkpoint.hf_safetensors import HFCheckpoint
from hybrid2d.checkpoint.reader import (
    check_model_shapes,
    expected_model_shapes,
    iter_model_tensors,
    read_config,
)
from hybrid2d.config import JobConfig, LoraConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.models.llama import copy_full_into
from hybrid2d.parallel.lora import adapter_shapes, adapter_state

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's key of a wrapped causal LM's parameter


def run_model_shapes(cfg: JobConfig) -> dict[str, tuple[int, ...]]:
    """The model tensors a training checkpoint of this run holds: the adapters (LoRA) or the
    whole model."""
    if cfg.lora.rank:
        return adapter_shapes(cfg.model, cfg.lora)
    return expected_model_shapes(cfg.model)


def base_source(cfg: JobConfig) -> str:
    """Where a LoRA run's frozen base comes from, in words that compare: the resolved path of
    init_from, or the seeded init; with its dtype."""
    if cfg.checkpoint.init_from:
        kind, path = parse_init_from(cfg.checkpoint.init_from)
        where = f"{kind}:{os.path.realpath(path)}"
    else:
        where = f"the seeded init (train.seed={cfg.train.seed})"
    return f"{where} in {cfg.lora.base_dtype}"


def check_same_base(path: Path, cfg: JobConfig) -> None:
    """One line if the LoRA checkpoint at `path` was trained on another base than this run's."""
    saved = read_config(path)
    if not cfg.lora.rank or saved is None or not saved.lora.rank:
        return
    theirs, mine = base_source(saved), base_source(cfg)
    if theirs != mine:
        hint = (
            f"--checkpoint.init_from {saved.checkpoint.init_from}"
            if saved.checkpoint.init_from
            else f"--train.seed {saved.train.seed} and no checkpoint.init_from"
        )
        raise ConfigError(
            f"checkpoint {path} holds adapters trained on the base {theirs}, this launch's base "
            f"is {mine}; resume with {hint} --lora.base_dtype {saved.lora.base_dtype}"
        )


def peft_config(cfg: JobConfig, base_model: str | None) -> dict:
    """adapter_config.json of a run's adapters, as PEFT's LoraConfig writes it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": sorted(cfg.lora.target_names()),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft(step_dir: Path, meta, out: Path, dtype: torch.dtype) -> tuple[JobConfig, int]:
    """Write `out`/adapter_model.safetensors + adapter_config.json from a LoRA training
    checkpoint (its metadata `meta` read); returns the run's settings and the tensor count."""
    cfg = read_config(step_dir)
    if cfg is None or not cfg.lora.rank:
        raise ConfigError(
            f"checkpoint {step_dir} is not a LoRA run's (lora.rank=0 or no config.json); "
            "export it whole with tools/export_checkpoint.py"
        )
    shapes = run_model_shapes(cfg)
    check_model_shapes(step_dir, meta, shapes, cfg.model)
    tensors = {
        PEFT_PREFIX + name: t.to(dtype).contiguous()
        for name, t in iter_model_tensors(step_dir, meta, list(shapes))
    }
    base = None
    if cfg.checkpoint.init_from:
        kind, path = parse_init_from(cfg.checkpoint.init_from)
        base = os.path.realpath(path) if kind == "hf" else None
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, base), indent=2) + "\n")
    return cfg, len(tensors)


def read_peft(path: str, lcfg: LoraConfig, model: ModelConfig) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory's tensors under our names, checked against this run's LoRA
    settings and model (one line for each mismatch: rank, alpha, targets, a tensor's name or
    shape, as an adapter of another architecture has)."""
    where = f"lora.init_from={path}"
    config_file, weights = Path(path) / ADAPTER_CONFIG, Path(path) / ADAPTER_WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise ConfigError(f"{where}: no {f.name} there; give a PEFT adapter directory")
    try:
        saved = json.loads(config_file.read_text())
    except ValueError as e:
        raise ConfigError(f"{where}: {ADAPTER_CONFIG} is not JSON ({e})") from None
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: {ADAPTER_CONFIG} is not a LoRA adapter's (peft_type LORA)")
    for key, mine, flag in (("r", lcfg.rank, "rank"), ("lora_alpha", lcfg.alpha, "alpha")):
        if saved.get(key) != mine:
            raise ConfigError(
                f"{where}: the adapter has {key}={saved.get(key)}, this run lora.{flag}={mine}; "
                f"use --lora.{flag} {saved.get(key)}"
            )
    targets = saved.get("target_modules")
    theirs = sorted(targets) if isinstance(targets, list) else targets
    if theirs != sorted(lcfg.target_names()):
        raise ConfigError(
            f"{where}: the adapter targets {theirs}, this run {sorted(lcfg.target_names())}; "
            f"use --lora.targets {','.join(theirs) if isinstance(theirs, list) else theirs}"
        )
    shapes = adapter_shapes(model, lcfg)
    out = {}
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            name = key.removeprefix(PEFT_PREFIX)
            shape = tuple(f.get_slice(key).get_shape())
            if shapes.get(name) != shape:
                raise ConfigError(
                    f"{where}: {key} (shape {list(shape)}) fits no adapter of this model "
                    f"({name} here: {list(shapes[name]) if name in shapes else 'none'}); "
                    "an adapter for another model or architecture"
                )
            out[name] = f.get_tensor(key)
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ConfigError(f"{where}: the adapter has no {missing[0]}")
    return out


@torch.no_grad()
def load_peft(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `read_peft`'s tensors into the model's adapters (each rank its own shard)."""
    for name, param in adapter_state(model).items():
        copy_full_into(param, tensors[name])


def export_merged(step_dir: Path, meta, out: Path) -> int:
    """Write `out` as the base HF directory (`checkpoint.init_from hf:`) with every targeted
    weight replaced by W + (alpha / rank) B A, in the base file's dtype: a plain HF model. Holds
    the whole model in this process (an export tool's job, not a training rank's); returns the
    number of merged weights."""
    cfg = read_config(step_dir)
    kind, base = parse_init_from(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else ("", "")
    if kind != "hf":
        raise ConfigError(
            f"--merged needs the run's base as a HF directory (checkpoint.init_from hf:PATH); "
            f"this run's is {cfg.checkpoint.init_from or 'the seeded init'!r}"
        )
    adapters = dict(iter_model_tensors(step_dir, meta, list(run_model_shapes(cfg))))
    scale = cfg.lora.alpha / cfg.lora.rank
    tensors, merged = {}, 0
    with HFCheckpoint(base) as ckpt:
        for name in ckpt.tensors:
            w = ckpt.read(name)
            stem = name.removesuffix(".weight")
            if f"{stem}.lora_A.weight" in adapters:
                a, b = adapters[f"{stem}.lora_A.weight"], adapters[f"{stem}.lora_B.weight"]
                w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
                merged += 1
            tensors[name] = w.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for entry in os.listdir(base):  # config.json, generation config, tokenizer files
        src = os.path.join(base, entry)
        if os.path.isfile(src) and not entry.endswith(".safetensors") and "index" not in entry:
            shutil.copyfile(src, out / entry)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return merged
