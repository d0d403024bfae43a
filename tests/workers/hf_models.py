"""Tiny random HF Llama checkpoints made offline with transformers (the reference), for tests."""

from __future__ import annotations

import json
import os

import torch

# name -> (LlamaConfig kwargs, write the config.json the transformers-4 way)
CASES = {
    # GQA, llama3 RoPE scaling, vocab 130: a 2x2 mesh splits its 65 rows per tp rank 33/32.
    "gqa-llama3": (
        dict(
            num_key_value_heads=2,
            vocab_size=130,
            intermediate_size=96,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        False,
    ),
    # MHA, config.json rewritten with top-level rope_theta / rope_scaling (transformers 4).
    "mha-legacy-config": (
        dict(
            num_key_value_heads=8,
            vocab_size=128,
            intermediate_size=112,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
        True,
    ),
    "tied": (
        dict(
            num_key_value_heads=4,
            vocab_size=128,
            intermediate_size=96,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        False,
    ),
}


def to_legacy_config(path: str) -> None:
    """Rewrite a transformers-5 config.json with top-level rope_theta and rope_scaling."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def make_hf_model(name: str, path: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Save a random tiny LlamaForCausalLM for CASES[name] in several shards; return it."""
    import transformers

    kwargs, legacy = CASES[name]
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are ones at init: make them count
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(path, max_shard_size="100KB")
    if legacy:
        to_legacy_config(path)
    # A tokenizer file next to the weights, as in published directories.
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}, f)
    return model
