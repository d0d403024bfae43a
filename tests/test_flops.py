"""flops_per_token (the numerator of MFU) against torch's FlopCounterMode on a real step."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hybrid2d.config import ModelConfig
from hybrid2d.metrics import flops_per_token
from hybrid2d.models.attention import dense_mask
from hybrid2d.models.llama import Llama
from tests.family_shapes import FAMILIES, family_model


@pytest.mark.parametrize(
    "shape",
    [
        dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512),
        dict(dim=48, n_layers=3, n_heads=6, n_kv_heads=6, ffn_dim=96, vocab_size=320),
        dict(
            dim=64,
            n_layers=1,
            n_heads=4,
            n_kv_heads=1,
            ffn_dim=160,
            vocab_size=256,
            tie_embeddings=True,
        ),
    ],
    ids=["gqa", "mha", "tied"],
)
def test_flops_per_token_equals_counted_matmuls(shape):
    model_cfg = ModelConfig(**shape)
    model = Llama(model_cfg)
    model.init_weights(0)
    batch, seq = 2, 24
    x = torch.randint(0, model_cfg.vocab_size, (batch, seq + 1))
    # The math backend spells attention as bmm, which the counter sees (CPU flash is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) == {"aten.mm", "aten.bmm"}
    # Weights: every mm; attention: the math path computes the whole score square, of which a
    # causal model uses the s (s + 1) / 2 pairs on and below the diagonal (what flops_per_token
    # counts).
    counted = counts["aten.mm"] + counts["aten.bmm"] * (seq + 1) / (2 * seq)
    assert flops_per_token(model_cfg, seq) * batch * seq == pytest.approx(counted, rel=1e-12)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_per_token_of_each_family_equals_counted_matmuls(family):
    """Each family's switches (head_dim != dim / heads, biases, q/k norms, GELU, sandwich norms,
    sliding windows shorter than the sequence) against torch's count of one step. The math
    backend computes every layer's whole score square; the pairs a layer attends are those its
    own mask (models/attention.py) lets through, counted from the mask itself."""
    cfg = family_model(family)
    model = Llama(cfg)
    model.init_weights(0)
    batch, seq = 2, 13
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) <= {"aten.mm", "aten.addmm", "aten.bmm"}, counts
    cpu = torch.device("cpu")
    pairs = [
        int(dense_mask(None, cfg.layer_window(i), seq, cpu).sum()) for i in range(cfg.n_layers)
    ]
    attention = counts["aten.bmm"] / cfg.n_layers * sum(pairs) / seq**2
    counted = counts["aten.mm"] + counts.get("aten.addmm", 0) + attention
    assert flops_per_token(cfg, seq) * batch * seq == pytest.approx(counted, rel=1e-12)
    if cfg.sliding_window:  # the window is shorter than the sequence: fewer pairs than causal
        assert sum(pairs) < cfg.n_layers * seq * (seq + 1) // 2


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_packed_rows_count_only_the_pairs_inside_each_document(family):
    """MFU's numerator for packed rows: matmuls of the real tokens, attention over the (query,
    key) pairs inside each document (and window), none for the padding at a row's end. Checked
    against torch's count of one step on those rows (weights: per real token; attention: the
    math backend's whole score square times the share of pairs each layer's own mask, read on
    the real positions only, lets through)."""
    from hybrid2d.data.batch import Batch
    from hybrid2d.metrics import attended_pairs, step_flops

    cfg = family_model(family)
    model = Llama(cfg)
    model.init_weights(0)
    seq = 13
    # Row 0: documents of 5, 3 and 4 tokens, then one padding position (its own document);
    # row 1: documents of 7 and 6 tokens, no padding.
    docs = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4 + [3], [0] * 7 + [1] * 6])
    real = torch.tensor([12, 13])
    inputs = torch.randint(0, cfg.vocab_size, (2, seq))
    labels = torch.randint(0, cfg.vocab_size, (2, seq))
    batch = Batch(inputs, labels, docs, real)
    assert batch.document_lengths() == [5, 3, 4, 7, 6]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(inputs, docs)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    is_real = torch.arange(seq)[None, :] < real[:, None]  # [b, s]
    real_pairs = is_real[:, None, :, None] & is_real[:, None, None, :]
    pairs = [
        int((dense_mask(docs, cfg.layer_window(i), seq, torch.device("cpu")) & real_pairs).sum())
        for i in range(cfg.n_layers)
    ]
    weights = (counts["aten.mm"] + counts.get("aten.addmm", 0)) * int(real.sum()) / inputs.numel()
    attention = counts["aten.bmm"] / cfg.n_layers * sum(pairs) / (2 * seq**2)
    got = step_flops(cfg, batch.tokens, attended_pairs(cfg, batch.document_lengths()))
    assert got == pytest.approx(weights + attention, rel=1e-12)
    # One sequence per row (the pairs a row of `seq` tokens attends) counts more.
    assert attended_pairs(cfg, [seq, seq]) > attended_pairs(cfg, batch.document_lengths())
