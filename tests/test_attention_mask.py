"""The mask description and its kernels against a plain reference: each document alone through
causal softmax attention, written out with matmuls (no SDPA)."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid2d.models.attention import (
    attend,
    block_mask,
    build_mask,
    dense_mask,
    document_positions,
)


def reference(q, k, v, documents, window, scale=None):
    """Scores over explicit (query, key) loops' worth of masking: softmax over the keys each
    query may see, computed per query position."""
    b, h, s, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = scale or 1 / math.sqrt(d)
    out = torch.zeros_like(q)
    for bi in range(b):
        for i in range(s):
            keys = [
                j
                for j in range(i + 1)
                if (not window or j > i - window)
                and (documents is None or documents[bi, j] == documents[bi, i])
            ]
            scores = (q[bi, :, i : i + 1] @ k[bi, :, keys].transpose(-1, -2)) * scale
            out[bi, :, i] = (scores.softmax(-1) @ v[bi, :, keys])[:, 0]
    return out


def test_document_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 7]])
    pos = document_positions(docs)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 0]]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("with_documents", [False, True])
def test_kernels_equal_reference(window, with_documents):
    torch.manual_seed(0)
    b, h, kv, s, d = 2, 6, 2, 13, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64) for n in (h, kv, kv))
    docs = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [0] + [1] * 12]) if with_documents else None
    want = reference(q, k, v, docs, window, scale=0.3)
    mask = build_mask(docs, window, s, q.device)
    if docs is None and not window:
        assert mask is None
    got = attend(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # The CUDA kernel's mask, run by FlexAttention's reference path here on CPU.
    dense = dense_mask(docs, window, s, q.device)
    flex = attend(q.float(), k.float(), v.float(), block_mask(docs, window, s, "cpu"), scale=0.3)
    torch.testing.assert_close(flex.double(), want, rtol=1e-5, atol=1e-5)
    assert dense.dtype == torch.bool and dense.shape[-2:] == (s, s)
