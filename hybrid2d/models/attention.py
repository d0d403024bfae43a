"""Which keys each query sees, described once per batch, and the kernel that computes it.

Attention is always causal. Two things narrow it further:

- documents: a packed row holds several documents (instruction samples, or text documents with
  document masking), given as a document index per position; a query sees only keys of its own
  document, and RoPE positions restart at 0 at each document start;
- a sliding window: on sliding layers (Gemma 3's local layers, Mistral configs with
  `sliding_window`) a query sees only the last `window` keys, itself included (transformers'
  `kv_idx > q_idx - window`).

The model builds one mask per kind of layer per batch (`build_mask`), and every layer of that kind
reuses it. What the mask is depends on the device, chosen here and nowhere else:

- plain causal (no documents, no window): None, and SDPA's `is_causal` (flash / memory-efficient
  kernels on CUDA, the fused CPU kernel), exactly as before masks existed;
- CUDA: a FlexAttention `BlockMask`, so the kernel skips every block that is fully masked (whole
  other documents, keys beyond the window) instead of reading a dense [s, s] mask;
- CPU: a dense boolean [b, 1, s, s] mask for SDPA, the fastest exact option measured on the
  test bed (`tools/bench_packing.py masks`: at seq 2048, forward + backward of one layer 884 ms
  against 1154 ms for a loop over documents and 564 ms for plain causal, which is not exact);
  eager FlexAttention is about 11x slower forward and torch 2.13 has no CPU backward for it.

With sequence parallelism attention sees the whole sequence (the plan gathers it on entry), so
masks and positions always cover the full row and need no splitting over tp.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:  # FlexAttention is public in torch >= 2.5; the CPU test bed may still lack a compiler.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - every supported torch has it
    BlockMask = None


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document: [b, s] document indices -> [b, s] positions
    that restart at 0 wherever the document index changes."""
    seq = documents.shape[-1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    start_of_doc = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - start_of_doc


def _allowed(documents: torch.Tensor | None, window: int):
    """The mask as a predicate on (batch, head, query index, key index), FlexAttention's
    convention (True: the query sees the key)."""

    def allowed(b, h, q, k):
        keep = k <= q
        if window:
            keep = keep & (k > q - window)
        if documents is not None:
            keep = keep & (documents[b, q] == documents[b, k])
        return keep

    return allowed


def dense_mask(
    documents: torch.Tensor | None, window: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Boolean [b, 1, s, s] (b = 1 without documents): True where a query sees a key."""
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    keep = k <= q
    if window:
        keep = keep & (k > q - window)
    keep = keep[None, None]
    if documents is not None:
        keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])
    return keep


def block_mask(
    documents: torch.Tensor | None, window: int, seq_len: int, device: torch.device
) -> BlockMask:
    """FlexAttention's block-sparse mask: fully masked blocks are never computed."""
    batch = None if documents is None else documents.shape[0]
    return create_block_mask(
        _allowed(documents, window), batch, None, seq_len, seq_len, device=device
    )


def build_mask(
    documents: torch.Tensor | None, window: int, seq_len: int, device: torch.device
) -> torch.Tensor | BlockMask | None:
    """The mask of one kind of layer for one batch, in the form this device's kernel takes."""
    if documents is None and not window:
        return None
    if device.type == "cuda":
        return block_mask(documents, window, seq_len, device)
    return dense_mask(documents, window, seq_len, device)


@functools.cache
def _compiled_flex():
    # FlexAttention is only fast compiled (the eager call is a reference implementation).
    return torch.compile(flex_attention, dynamic=False)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask | None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [b, heads, s, hd] and k, v [b, kv_heads, s, hd]
    (grouped-query heads are shared, never copied)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if BlockMask is not None and isinstance(mask, BlockMask):
        flex = _compiled_flex() if q.device.type == "cuda" else flex_attention
        return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
