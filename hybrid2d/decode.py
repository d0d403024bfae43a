"""Incremental decoding with a key/value cache over a plain `Llama`: each new token costs one
token's forward instead of the whole sequence's.

The model keeps its one forward path; `Decoder` calls the model's own modules (embedding,
norms, `Attention.rotated_qkv`, o projections, MLPs, head) and RoPE tables (`model.rope`) in the
same order as `Llama.forward`, keeping each layer's rotated keys and values. `prefill` runs the
prompt with causal attention, as the model does; `step` then feeds one token, whose query attends
to every cached key (the newest position sees all earlier ones, so it needs no mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid2d.models.llama import Llama


class Decoder:
    """Logits of a sequence fed a prompt at a time and then one token at a time.

    The cache is preallocated to `capacity` positions: each token writes its slot in place, where
    concatenation would copy the whole cache for every token.
    """

    def __init__(self, model: Llama, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity {capacity} must be >= 1")
        self.model = model
        self.capacity = capacity
        self.length = 0  # positions cached
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Empty the cache, run tokens[b, s] (causal attention) and cache them; logits[b, s, V]."""
        if not 1 <= tokens.shape[1] <= self.capacity:
            raise ValueError(f"prefill of {tokens.shape[1]} tokens: capacity is {self.capacity}")
        self.length = 0
        self.keys, self.values = [], []
        return self._forward(tokens)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run tokens[b, 1] after the cached positions and cache it; logits[b, 1, V]."""
        if self.length == 0:
            raise ValueError("step before prefill: the cache is empty")
        if tokens.shape[1] != 1:
            raise ValueError(f"step takes one token per sequence, not {tokens.shape[1]}")
        if self.length >= self.capacity:
            raise ValueError(f"the cache is full ({self.capacity} positions)")
        return self._forward(tokens)

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.model.embed_tokens(tokens)
        if self.cos is None or self.cos.dtype != h.dtype:
            # Row p of the table is what Llama.forward uses at position p for any length.
            self.cos, self.sin = m.rope(self.capacity, h.dtype)
        start, seq = self.length, tokens.shape[1]
        cos, sin = self.cos[start : start + seq], self.sin[start : start + seq]
        for i, layer in enumerate(m.model.layers):
            h = h + self._attention(i, layer.self_attn, layer.input_layernorm(h), cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.length = start + seq
        return m.lm_head(m.model.norm(h))

    def _attention(self, i, attn, x, cos, sin) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = attn.rotated_qkv(x, cos, sin)
        start, end = self.length, self.length + seq
        if start == 0:  # prefill: this layer's cache, sized once
            shape = (bsz, k.shape[1], self.capacity, attn.head_dim)
            self.keys.append(k.new_empty(shape))
            self.values.append(v.new_empty(shape))
        self.keys[i][:, :, start:end] = k
        self.values[i][:, :, start:end] = v
        keys, values = self.keys[i][:, :, :end], self.values[i][:, :, :end]
        out = F.scaled_dot_product_attention(
            q, keys, values, is_causal=start == 0, enable_gqa=q.shape[1] != k.shape[1]
        )
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
