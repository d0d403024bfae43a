"""Tiny models of every family, with odd shapes: grouped-query heads, head_dim != dim / heads,
biases, tied and untied embeddings, windows shorter than the test sequences. Shared by the
FLOP, memory and planner tests of each family."""

from hybrid2d.config import ModelConfig

_BASE = dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=320)

FAMILIES = {
    "llama": dict(_BASE),
    "mistral": dict(_BASE, family="mistral", sliding_window=7),
    "qwen2": dict(_BASE, family="qwen2", qkv_bias=True, n_kv_heads=1),
    "qwen3": dict(
        _BASE, family="qwen3", attn_head_dim=20, qk_norm=True, tie_embeddings=True, norm_eps=1e-6
    ),
    "gemma3": dict(
        _BASE,
        family="gemma3",
        n_layers=3,
        n_kv_heads=1,
        attn_head_dim=16,
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        scale_embeddings=True,
        attn_scale_base=12.0,
        sliding_window=5,
        layer_types="SSF",
        rope_theta=1e6,
        rope_local_theta=1e4,
        tie_embeddings=True,
        norm_eps=1e-6,
    ),
}


def family_model(name: str, **changes) -> ModelConfig:
    return ModelConfig(**(FAMILIES[name] | changes))
