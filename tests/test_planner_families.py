"""The planner's pieces for the other families: tensor parallelism past the kv heads, priced
against hand counts of what each rank holds and computes; packed rows' masks against a
measurement."""

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid2d.config import JobConfig
from hybrid2d.layout import RunLayout
from hybrid2d.models.llama import Llama
from hybrid2d.planner import hardware, ops
from hybrid2d.planner.memory import estimate
from hybrid2d.planner.model import flops, predict_valid
from hybrid2d.profiling.measure import MemoryTracker
from tests.family_shapes import FAMILIES, family_model


def job(model, tp: int) -> tuple[JobConfig, RunLayout]:
    """One dp rank, `tp` tensor-parallel ranks, fp32 CPU. The layout is made directly: the
    planner prices a mesh whatever the trainer's checks say of it."""
    cfg = JobConfig(model=model)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.device = 16, 2, "cpu"
    return cfg, RunLayout(1, 1, tp, 2, 2, "none", model)


def held_per_rank(m, tp: int) -> int:
    """Parameters one rank holds, by hand: q, o, the MLP, embedding and head split over tp;
    k and v (and their biases) split over tp only while tp <= kv heads, else whole."""
    hd, kv_split = m.head_dim, tp if tp <= m.n_kv_heads else 1
    q = m.n_heads * hd * (m.dim + m.qkv_bias) // tp
    kv = 2 * m.n_kv_heads * hd * (m.dim + m.qkv_bias) // kv_split
    o = m.dim * m.n_heads * hd // tp
    mlp = 3 * m.dim * m.ffn_dim // tp
    norms = 2 * m.dim + (2 * hd if m.qk_norm else 0)
    root = m.vocab_size * m.dim // tp * (1 if m.tie_embeddings else 2) + m.dim
    return m.n_layers * (q + kv + o + mlp + norms) + root


@pytest.mark.parametrize("family,tp", [("qwen2", 2), ("qwen2", 4), ("qwen3", 2), ("qwen3", 4)])
def test_tp_past_the_kv_heads_holds_whole_kv_weights(family, tp):
    """qwen2's shape has 1 kv head (so tp 2 and 4 replicate it), qwen3's 2 (tp 4 does)."""
    m = family_model(family)
    cfg, layout = job(m, tp)
    est = estimate(cfg, layout, 0, "cpu")
    n = held_per_rank(m, tp)
    assert est.parameters == 4 * n + m.head_dim // 2 * 4  # + inv_freq
    assert est.gradients == 4 * n
    assert est.optimizer == 2 * 4 * n + 4 * len(list(_tensors(m)))


def _tensors(m):
    from hybrid2d.planner.memory import model_params

    return model_params(m)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_past_the_kv_heads_computes_the_shared_kv_head_on_each_rank(tp):
    """Each rank projects k and v for the one kv head its query heads use: per rank
    12 x dim x head_dim FLOPs a token and block (forward + backward, k and v) where the model
    needs 12 x dim x head_dim x kv_heads / tp; the MFU numerator stays the model's."""
    m = family_model("qwen2")  # 1 kv head, 4 query heads
    cfg, layout = job(m, tp)
    f = flops(m, 16, "none", tp)
    tokens = 2 * 16  # the dp group's tokens, all seen by each of its tp ranks
    per_rank = 12 * m.dim * m.head_dim * m.n_layers * tokens
    share = per_rank * m.n_kv_heads / tp
    assert f["replicated_matmul"] * tokens / tp == pytest.approx(max(0.0, per_rank - share))
    cand = predict_valid(cfg, layout, hardware.get("cpu"), 4)
    assert cand.details["replicated_flops_per_rank"] == pytest.approx(
        max(0.0, per_rank - share), rel=1e-12
    )
    assert cand.details["flops_per_token"] == f["model"]
    assert math.isfinite(cand.step_s) and cand.step_s > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_packed_rows_cost_what_the_estimate_adds(family):
    """Rows packed with documents (issue 35): every layer gets a mask per row and RoPE tables
    per row. The estimate's change (documents=True against False) equals the measured change
    of the peak of one forward + backward of the same model and batch."""
    m = family_model(family, dim=128, ffn_dim=352, vocab_size=2048)
    b, s = 4, 128
    model = Llama(m)
    model.init_weights(0)
    tokens = torch.randint(0, m.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    docs = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([50, 40, s - 90]))
    peaks = []
    for documents in (None, docs.expand(b, s).clone()):
        x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        with MemoryTracker(model) as tracker:
            F.cross_entropy(model(x, documents).flatten(0, 1), y.flatten()).backward()
        peaks.append(tracker.peak)
        model.zero_grad(set_to_none=True)
    cfg = JobConfig(model=m)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.device = s, b, "cpu"
    layout = RunLayout(1, 1, 1, b, b, "none", m)
    plain = estimate(cfg, layout, 0, "cpu")
    added = estimate(cfg, layout, 0, "cpu", documents=True).peak - plain.peak
    assert added == peaks[1] - peaks[0] > 0


def test_dispatched_ops_follow_the_family_structure():
    """The per-op price counts each family's own block (`ops.block_step` builds the family's
    decoder layer): biases add ops, q/k norms more, Gemma 3's sandwich block more still; a
    window alone changes the mask a block is given, not its ops."""
    counts = {f: ops.block_ops(family_model(f), "none") for f in FAMILIES}
    assert counts["mistral"] == counts["llama"]
    assert counts["llama"] < counts["qwen2"] < counts["qwen3"] < counts["gemma3"], counts
    layer = ops.decoder_layer(ops.tiny(family_model("gemma3")))
    assert hasattr(layer, "pre_feedforward_layernorm")
