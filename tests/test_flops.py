"""flops_per_token (the numerator of MFU) against torch's FlopCounterMode on a real step."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hybrid2d.config import ModelConfig
from hybrid2d.metrics import flops_per_token
from hybrid2d.models.llama import Llama


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
    # causal model uses half (what flops_per_token counts).
    counted = counts["aten.mm"] + counts["aten.bmm"] / 2
    assert flops_per_token(model_cfg, seq) * batch * seq == counted
