"""A checkpoint as a plain, unsharded model in one process (for generation and inspection).

Takes a DCP training checkpoint (a step directory, or a run / checkpoints directory meaning its
latest checkpoint) or an exported Hugging Face directory (config.json + safetensors). The model
is built on the meta device and the loaded tensors are assigned to it, so the process holds one
copy of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid2d.checkpoint import integrity, layout
from hybrid2d.checkpoint.hf import check_tensor_names, model_config_from_hf
from hybrid2d.checkpoint.hf_safetensors import INDEX_NAME, SINGLE_NAME, HFCheckpoint, load_json
from hybrid2d.checkpoint.reader import (
    iter_model_tensors,
    model_entries,
    read_config,
    read_metadata,
)
from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.errors import ConfigError
from hybrid2d.models.llama import Llama, rope_inv_freq

HYBRID2D_CONFIG = "hybrid2d_config.json"  # the run's JobConfig, kept next to an export


@dataclass
class Source:
    path: Path  # the step directory, or the exported directory
    kind: str  # "dcp" | "hf"


def locate(setting: str, what: str = "checkpoint") -> Source:
    """Which checkpoint `setting` names; ConfigError (one line) if none."""
    p = Path(setting).expanduser()
    if not p.exists():
        raise ConfigError(f"{what} {setting!r} does not exist")
    if not p.is_dir():
        raise ConfigError(f"{what} {setting!r} is a file; pass a checkpoint directory")
    if (p / SINGLE_NAME).is_file() or (p / INDEX_NAME).is_file():
        return Source(p, "hf")
    return Source(layout.resolve_dir(p, what, setting), "dcp")


def verify(path: Path) -> None:
    """ConfigError if a DCP checkpoint's files differ from its checksums.json (all checked)."""
    problem = integrity.verify(path)
    if problem:
        raise ConfigError(f"checkpoint {path} is damaged: {problem}")


def model_config(src: Source) -> ModelConfig:
    if src.kind == "dcp":
        saved = read_config(src.path)
        if saved is None:
            raise ConfigError(
                f"checkpoint {src.path} has no {layout.CONFIG}; cannot tell the model's shape"
            )
        if saved.lora.rank:
            base = saved.checkpoint.init_from or f"the seeded init of train.seed={saved.train.seed}"
            raise ConfigError(
                f"checkpoint {src.path} is a LoRA run's: it holds the adapters, not the model; "
                f"write them for PEFT with tools/export_lora.py and load them over {base}"
            )
        return saved.model
    own = src.path / HYBRID2D_CONFIG
    if own.is_file():
        return JobConfig.from_dict(load_json(own)).model
    return model_config_from_hf(load_json(src.path / "config.json"), str(src.path / "config.json"))


def _tensors(src: Source, cfg: ModelConfig):
    """(name, tensor) for the model's tensors one at a time, once every name and shape is
    checked against cfg (before anything is read)."""
    where = str(src.path)
    if src.kind == "dcp":
        meta = read_metadata(src.path)
        found = {n: tuple(t.size) for n, t in model_entries(meta, src.path).items()}
        yield from iter_model_tensors(src.path, meta, check_tensor_names(found, cfg, where))
        return
    with HFCheckpoint(where) as ckpt:
        for name in check_tensor_names({n: t.shape for n, t in ckpt.tensors.items()}, cfg, where):
            yield name, ckpt.read(name)


def load_model(src: Source, dtype: torch.dtype = torch.float32) -> tuple[Llama, ModelConfig]:
    """The whole model in this process, in eval mode."""
    cfg = model_config(src)
    with torch.device("meta"):
        model = Llama(cfg)
    state = {name: tensor.to(dtype) for name, tensor in _tensors(src, cfg)}
    model.load_state_dict(state, strict=False, assign=True)  # a tied lm_head may be absent
    model.inv_freq = rope_inv_freq(cfg)  # buffers are in no checkpoint: computed
    if cfg.rope_local_theta:
        model.inv_freq_local = rope_inv_freq(cfg, local=True)
    model.tie_weights()
    return model.eval(), cfg


def tokenizer_path(src: Source) -> Path | None:
    """The tokenizer.json saved with the checkpoint (or next to an export), if any."""
    f = src.path / layout.TOKENIZER
    return f if f.is_file() else None
