"""The Llama 2 / 3 / 3.1 / 3.2 architecture, key for key HF `LlamaForCausalLM`.

Parameter names, shapes and the RoPE convention (rotate-half, non-interleaved) match HF
transformers, so a HF state dict loads with no renaming or permutation. The model is written so
that tensor parallelism needs no model changes: attention reads its local head count from the
projection outputs (`view(..., -1, head_dim)`), which is what column-parallel q/k/v produce.

Build it on the meta device, parallelise, then `to_empty` and `init_weights`.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint, noop_context_fn

from hybrid2d.config import ModelConfig
from hybrid2d.parallel.activation_checkpoint import output_not_kept, selective_context
from hybrid2d.parallel.sequence_comm import (
    gather_sequence,
    reduce_scatter_sequence,
    sum_grad_over_group,
    vocab_parallel_embedding,
)
from hybrid2d.parallel.shm_comm import transport_for


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of RoPE, with llama3 frequency scaling when configured."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if not cfg.rope_scaling_factor:
        return inv_freq
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight
        if isinstance(weight, DTensor) and not isinstance(x, DTensor):
            # Sequence parallel on plain tensors (parallel.local_norms): this rank normalises its
            # slice of the sequence, so its weight gradient is a partial sum over tp ranks.
            mesh = weight.device_mesh
            group = mesh.get_group(mesh.ndim - 1)
            if transport_for(group) is not None:  # summed by shared memory in backward
                weight = weight.to_local(grad_placements=[Replicate()] * mesh.ndim)
                weight = sum_grad_over_group(weight, group)
            else:
                weight = weight.to_local(grad_placements=[Partial()] * mesh.ndim)
        return weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (a plain tensor stays as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def fused_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """x @ [W1; W2; ...]^T as one matmul over the local shards, split back per projection.

    Under column-parallel TP each weight is Shard(0): its local rows are this rank's heads (or
    ffn slice), so concatenating local shards is the fused local weight. A replicated DTensor
    input becomes a plain tensor whose gradient is a partial sum over tp ranks (each rank only
    back-propagates through its own heads), which is exactly what the reduce-scatter in
    backward expects.
    """
    weights = [_local(lin.weight) for lin in linears]
    if isinstance(x, DTensor):
        x = x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
    out = F.linear(x, torch.cat(weights))
    return out.split([w.shape[0] for w in weights], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        # One matmul for q, k and v instead of three (parallel.fused_projections).
        self.fused = False
        # Set by apply_tp with parallel.direct_sp_comm: x arrives as a sequence shard and the
        # block gathers / reduce-scatters it itself (parallel/sequence_comm.py).
        self.sp_group = None
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            x = gather_sequence(x, self.sp_group)
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism these are this rank's heads only.
        if self.fused:
            q, k, v = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        if self.sp_group is not None:  # row-parallel o_proj by hand: local matmul, then sum
            with output_not_kept():
                partial = F.linear(out, _local(self.o_proj.weight))
            return reduce_scatter_sequence(partial, self.sp_group)
        with output_not_kept():
            return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.fused = False  # gate and up as one matmul (parallel.fused_projections)
        self.sp_group = None  # as in Attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            x = gather_sequence(x, self.sp_group)
        if self.fused:
            gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = F.silu(gate) * up
        if self.sp_group is not None:
            with output_not_kept():
                partial = F.linear(hidden, _local(self.down_proj.weight))
            return reduce_scatter_sequence(partial, self.sp_group)
        with output_not_kept():
            return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack; named `model` inside `Llama`, as in HF."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


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
        # Recompute each block's activations in backward instead of keeping them (see
        # parallel/activation_checkpoint.py).
        self.activation_checkpoint = "none"
        # parallel.direct_sp_comm: the tp process group. Embedding and output projection then
        # run on local vocabulary shards and forward returns [b, s, vocab/tp] local logits for
        # parallel.sequence_comm.vocab_parallel_cross_entropy.
        self.sp_group = None
        self.sp_mesh = None

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (after parallelisation replaced either)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            weight = _local(self.model.embed_tokens.weight)
            h = vocab_parallel_embedding(tokens, weight, self.sp_group)
        else:
            h = self.model.embed_tokens(tokens)
        # Under sequence parallelism h is this rank's slice of the sequence, but attention sees
        # the whole sequence, so RoPE tables are sized from the tokens.
        cos, sin = self.rope(tokens.shape[1], h.dtype)
        ac = self.activation_checkpoint
        for layer in self.model.layers:
            if ac in ("full", "selective") and torch.is_grad_enabled():
                context = selective_context if ac == "selective" else noop_context_fn
                h = checkpoint(layer, h, cos, sin, use_reentrant=False, context_fn=context)
            else:
                h = layer(h, cos, sin)
        h = self.model.norm(h)
        if self.sp_group is not None:
            logits = F.linear(gather_sequence(h, self.sp_group), _local(self.lm_head.weight))
            # The same DTensor (sharded on the vocabulary) that the DTensor path returns.
            return DTensor.from_local(logits, self.sp_mesh, [Shard(-1)], run_check=False)
        return self.lm_head(h)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter identically whatever the mesh.

        Each parameter's full value is drawn from a generator seeded by (seed, its name), then
        each rank keeps its own shard. So a (2, 2) run and a single-process run start from the
        same weights. Holds one full parameter at a time, never the whole model.
        """
        self.inv_freq.copy_(rope_inv_freq(self.cfg).to(self.inv_freq.device))
        for name, param in self.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("norm.weight"):
                full = torch.ones(shape)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = self.cfg.init_std
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = std / math.sqrt(2 * self.cfg.n_layers)
                full = torch.randn(shape, generator=gen) * std
            copy_full_into(param, full)


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
