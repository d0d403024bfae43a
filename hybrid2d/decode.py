"""Incremental decoding with a key/value cache over a plain `Llama` of any family: each new
token costs one token's forward instead of the whole sequence's.

The model keeps its one forward path; `Decoder` calls the model's own pieces (`embed`, norms,
`Attention.rotated_qkv`, o projections, the block's `attention_out` and `feed_forward`, head),
RoPE tables (`model.rope`, the local base on layers that have one) and layer kinds
(`model.layer_kind`) in the same order as `Llama.forward`, keeping each layer's rotated keys and
values. `prefill` runs the prompt with the model's own mask (causal, and the window on sliding
layers); `step` then feeds one token, whose query attends to every cached key, or on a sliding
layer to the last `window` of them: the newest position needs no mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid2d.models.attention import attend, build_mask
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
        self.tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # local -> (cos, sin)

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
        h = m.embed(tokens)
        start, seq = self.length, tokens.shape[1]
        masks = {}  # prefill: one mask per window, as Llama.forward builds them
        for i, layer in enumerate(m.model.layers):
            window, local = m.layer_kind(i)
            if local not in self.tables or self.tables[local][0].dtype != h.dtype:
                # Row p of the table is what Llama.forward uses at position p for any length.
                self.tables[local] = m.rope(self.capacity, h.dtype, local=local)
            cos, sin = (t[start : start + seq] for t in self.tables[local])
            if start == 0 and window not in masks:
                masks[window] = build_mask(None, window, seq, h.device)
            x = layer.input_layernorm(h)
            h = h + layer.attention_out(
                self._attention(i, layer.self_attn, x, cos, sin, window, masks.get(window))
            )
            h = h + layer.feed_forward(h)
        self.length = start + seq
        return m.lm_head(m.model.norm(h))

    def _attention(self, i, attn, x, cos, sin, window: int, mask) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = attn.rotated_qkv(x, cos, sin)
        start, end = self.length, self.length + seq
        if start == 0:  # prefill: this layer's cache, sized once
            shape = (bsz, k.shape[1], self.capacity, attn.head_dim)
            self.keys.append(k.new_empty(shape))
            self.values.append(v.new_empty(shape))
        self.keys[i][:, :, start:end] = k
        self.values[i][:, :, start:end] = v
        if start == 0:
            out = attend(q, k, v, mask, attn.scale)
        else:  # one query at position start: it sees the last `window` keys (all: window 0)
            first = max(0, end - window) if window else 0
            keys, values = self.keys[i][:, :, first:end], self.values[i][:, :, first:end]
            out = F.scaled_dot_product_attention(
                q, keys, values, scale=attn.scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
