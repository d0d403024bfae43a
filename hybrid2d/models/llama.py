"""The Llama-family decoder, key for key HF `LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` and `Gemma3ForCausalLM`.

One model: the families differ by `ModelConfig` switches (q/k/v biases, per-head q/k norms,
Gemma's (1 + w) norms and extra norms, the MLP's activation, scaled embeddings, the attention
scale, sliding windows and their RoPE base). A switch that is off builds no module and runs no
op, so the Llama path is what it was. Parameter names, shapes and the RoPE convention
(rotate-half, non-interleaved) match HF transformers, so a HF state dict loads with no renaming
or permutation. The model is written so that tensor parallelism needs no model changes:
attention reads its local head count from the projection outputs (`view(..., -1, head_dim)`),
which is what column-parallel q/k/v produce.

Build it on the meta device, parallelise, then `to_empty` and `init_weights`.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from hybrid2d.config import ModelConfig
from hybrid2d.models.attention import attend, build_mask, document_positions


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies of RoPE: of the global layers, with their frequency scaling when
    configured, or (`local`) of the sliding-window layers' own base, unscaled (Gemma 3)."""
    hd = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if local or not cfg.rope_scaling_factor:
        return inv_freq
    if cfg.rope_scaling_type == "linear":
        return inv_freq / cfg.rope_scaling_factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor = cfg.rope_scaling_factor
    low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) all in fp32, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    """HF's Llama RMSNorm. `normalize(x, weight)` is the arithmetic, so a parallel forward that
    passes its own view of the weight keeps the norm's kind."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm (HF `Gemma3RMSNorm`): scales by (1 + weight), so its weight starts at 0.
    A class, not a flag: the arithmetic and the initial value both differ. An RMSNorm to the
    parallel norm styles, which must compute through `normalize` (not `rms_norm`) to keep it."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm_plus_one(x, weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return (OffsetRMSNorm if cfg.norm_plus_one else RMSNorm)(dim, cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        # Per-head norms of queries and keys before RoPE (Qwen3, Gemma 3); None: not built.
        self.q_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, hd) if cfg.qk_norm else None
        # None: SDPA's own 1/sqrt(head_dim); Gemma 3 scales by 1/sqrt(query_pre_attn_scalar).
        self.scale = cfg.attn_scale_base**-0.5 if cfg.attn_scale_base else None

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v as [b, heads, s, head_dim], q and k normed (qk_norm) and rotated for the
        positions of cos/sin (also the KV-cache decoder's, hybrid2d/decode.py)."""
        bsz, seq, _ = x.shape
        # -1 heads: with column-parallel projections these are this rank's heads only.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None):
        bsz, seq, _ = x.shape
        q, k, v = self.rotated_qkv(x, cos, sin)
        out = attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        # Gated: silu (Llama, Mistral, Qwen) or GELU's tanh approximation (Gemma).
        self.act = ACTIVATIONS[cfg.mlp_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class DecoderLayer(nn.Module):
    """Pre-norm block (Llama, Mistral, Qwen): x + attn(norm(x)), then x + mlp(norm(x)).
    `post_attention_layernorm` is the MLP's input norm, as HF names it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.dim)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = make_norm(cfg, cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None):
        x = x + self.attention_out(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.feed_forward(x)

    def attention_out(self, a: torch.Tensor) -> torch.Tensor:
        """What the residual adds of the attention's output a."""
        return a

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the residual adds of the MLP, from the residual stream x."""
        return self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 3's block: attention and MLP each between two norms, before the residual add.

    A class of its own rather than a flag in `DecoderLayer`: HF's `post_attention_layernorm`
    means the MLP's input norm in Llama but the attention output's norm here (the MLP's input
    norm is `pre_feedforward_layernorm`), and a reader should not have to track that by flag.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.dim)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.dim)

    def attention_out(self, a: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(a)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def decoder_layer(cfg: ModelConfig) -> DecoderLayer:
    """The block of this config's family."""
    return (SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer)(cfg)


class LlamaModel(nn.Module):
    """The decoder stack; named `model` inside `Llama`, as in HF."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(decoder_layer(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.dim)


class Llama(nn.Module):
    """Causal LM. forward(tokens[b, s]) -> logits[b, s, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not persistent: HF's state dict has no rotary buffer either.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.rope_local_theta:
            self.register_buffer("inv_freq_local", rope_inv_freq(cfg, True), persistent=False)

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (after parallelisation replaced either)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(
        self, positions: torch.Tensor | int, dtype: torch.dtype, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` (an int s: 0..s-1; [s]; or [b, s] -> [b, 1, s, head_dim] to
        broadcast over heads); `local`: the sliding layers' own RoPE base."""
        inv_freq = self.inv_freq_local if local else self.inv_freq
        if isinstance(positions, int):
            positions = torch.arange(positions, device=inv_freq.device)
        freqs = positions.float()[..., None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.ndim == 3:
            emb = emb[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings; Gemma scales them by sqrt(dim) rounded to their dtype, as HF does
        (its scale is a buffer cast to the embedding's dtype)."""
        h = self.model.embed_tokens(tokens)
        if self.cfg.scale_embeddings:
            h = h * _rounded(math.sqrt(self.cfg.dim), h.dtype)
        return h

    def layer_kind(self, layer: int) -> tuple[int, bool]:
        """(sliding window or 0, whether the layer uses the local RoPE base) of `layer`."""
        window = self.cfg.layer_window(layer)
        return window, bool(window and self.cfg.rope_local_theta)

    def layer_inputs(
        self, seq_len: int, documents: torch.Tensor | None, dtype: torch.dtype
    ) -> list[tuple]:
        """(cos, sin, mask) of each layer, built once per kind of layer (window, RoPE base) for
        the whole sequence: attention always sees all of it, even when h between blocks is a
        slice of it (sequence parallelism)."""
        device = self.inv_freq.device
        if documents is None:
            positions = torch.arange(seq_len, device=device)
        else:
            positions = document_positions(documents.to(device))
        kinds: dict[tuple[int, bool], tuple] = {}
        out = []
        for i in range(self.cfg.n_layers):
            kind = self.layer_kind(i)
            window = kind[0]
            if kind not in kinds:
                cos, sin = self.rope(positions, dtype, local=kind[1])
                kinds[kind] = (cos, sin, build_mask(documents, window, seq_len, device))
            out.append(kinds[kind])
        return out

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens` [b, s]. `documents` [b, s]: the document index of each position
        of packed rows (attention stays inside a document, positions restart); None: each row
        is one sequence."""
        h = self.embed(tokens)
        inputs = self.layer_inputs(tokens.shape[1], documents, h.dtype)
        for layer, (cos, sin, mask) in zip(self.model.layers, inputs, strict=True):
            h = layer(h, cos, sin, mask)
        return self.lm_head(self.model.norm(h))

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the RoPE table (not in any state dict): after `to_empty`, for a model whose
        parameters are loaded from a checkpoint."""
        self.inv_freq.copy_(rope_inv_freq(self.cfg).to(self.inv_freq.device))
        if self.cfg.rope_local_theta:
            self.inv_freq_local.copy_(rope_inv_freq(self.cfg, True).to(self.inv_freq.device))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter identically whatever the mesh.

        Each parameter's full value is drawn from a generator seeded by (seed, its name), then
        each rank keeps its own shard. So a (2, 2) run and a single-process run start from the
        same weights. Holds one full parameter at a time, never the whole model.
        """
        self.init_buffers()
        for name, param in self.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("norm.weight"):  # 1 for x * w, 0 for Gemma's x * (1 + w)
                full = torch.zeros(shape) if self.cfg.norm_plus_one else torch.ones(shape)
            elif name.endswith(".bias"):  # as HF initialises biases
                full = torch.zeros(shape)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = self.cfg.init_std
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = std / math.sqrt(2 * self.cfg.n_layers)
                full = torch.randn(shape, generator=gen) * std
            copy_full_into(param, full)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as the nearest number of `dtype` (exact in the multiply that follows)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a plain or DTensor parameter's local shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds `full` and slices its own shard, no collective.
        param.copy_(
            distribute_tensor(
                full.to(param.device, param.dtype),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
        )
    else:
        param.copy_(full.to(param.device, param.dtype))
