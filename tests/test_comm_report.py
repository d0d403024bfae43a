"""Collectives of a real step, counted by CommDebugMode, against a formula written here from the
model's shape (not from hybrid2d.comm_report), and no collective the report cannot classify."""

import json

import pytest

from hybrid2d.config import ModelConfig
from tests.launch import check_ok, run_ranks
from tests.reference import tiny_config

pytestmark = pytest.mark.slow

F32 = 4

# CommDebugMode's op names (gloo or the shared-memory backend) -> the kind the report files
# them under. The worker's report must account for every op CommDebugMode saw.
OP_KIND = {
    "c10d_functional.all_gather_into_tensor": "tp_all_gather",
    "c10d_functional.reduce_scatter_tensor": "tp_reduce_scatter",
    "c10d_functional.all_reduce": "tp_all_reduce",
}
for prefix in ("c10d", "hybrid2d_shm"):
    OP_KIND[f"{prefix}._allgather_base_"] = "fsdp_all_gather"
    OP_KIND[f"{prefix}._reduce_scatter_base_"] = "fsdp_reduce_scatter"
    OP_KIND[f"{prefix}.allreduce_"] = "scalar_all_reduce"


def pad(rows: int, ways: int) -> int:
    return -(-rows // ways) * ways


# Every switch that changes the tensor-parallel collectives in one model: Qwen2's biases,
# Qwen3's q/k norms and odd head size, Gemma 3's sandwich (1 + w) norms, and a single kv head
# (so tp = 2 shares it).
ALL_SWITCHES_KV1 = dict(
    dim=48, n_layers=2, n_heads=4, n_kv_heads=1, attn_head_dim=14, ffn_dim=100, vocab_size=260,
    qkv_bias=True, qk_norm=True, sandwich_norms=True, norm_plus_one=True,
)  # fmt: skip


def expected(dp: int, tp: int, micro: int, model: dict | None = None) -> dict:
    """{kind: (count, payload bytes)} of one step on rank 0: payload = the full buffer (an
    all-gather's output, a reduce-scatter's input, an all-reduce's tensor), fp32."""
    cfg = tiny_config()
    if model:
        cfg.model = ModelConfig(**model)
    m, t = cfg.model, cfg.train
    local = t.global_batch // dp
    n_micro = local // micro if micro else 1
    tokens = (local // n_micro) * t.seq_len  # per micro batch
    hd = m.attn_head_dim or m.dim // m.n_heads
    # Past the kv heads every tp rank holds the whole k and v (and computes one head).
    kv_rows = m.n_kv_heads * hd // tp if tp <= m.n_kv_heads else m.n_kv_heads * hd
    out = {}
    if tp > 1:
        # Per micro batch: a block gathers the sequence before attention and before the MLP and
        # reduce-scatters after o_proj and down_proj (backward: the mirror image); the
        # embedding reduce-scatters, the head gathers (backward: the mirror image).
        n = (4 * m.n_layers + 2) * n_micro
        out["tp_all_gather"] = (n, n * tokens * m.dim * F32)
        out["tp_reduce_scatter"] = (n, n * tokens * m.dim * F32)
        # Loss parallel: 3 all-reduces over [tokens]; each norm weight's gradient (2 per block,
        # 4 with sandwich norms, and the final norm) is summed over tp, and so are the q/k
        # norms' (per head) and, when tp ranks share kv heads, the whole k and v weights' and
        # biases'.
        grads = [m.dim] * ((4 if m.sandwich_norms else 2) * m.n_layers + 1)
        if m.qk_norm:
            grads += [hd, hd] * m.n_layers
        if tp > m.n_kv_heads:
            grads += [kv_rows * m.dim] * 2 * m.n_layers
            grads += [kv_rows] * 2 * m.n_layers if m.qkv_bias else []
        out["tp_all_reduce"] = (
            (3 + len(grads)) * n_micro,
            (3 * tokens + sum(grads)) * F32 * n_micro,
        )
    if dp > 1:
        # FSDP units: each block and the root (embedding, final norm, head). Every parameter is
        # padded to a multiple of dp rows. Forward gathers every unit; backward gathers the
        # blocks again except the last (not resharded after forward); one reduce-scatter each.
        block = [
            (m.n_heads * hd // tp, m.dim),  # q
            (kv_rows, m.dim),  # k
            (kv_rows, m.dim),  # v
            (m.dim, m.n_heads * hd // tp),  # o
            (m.ffn_dim // tp, m.dim),  # gate
            (m.ffn_dim // tp, m.dim),  # up
            (m.dim, m.ffn_dim // tp),  # down
            (m.dim, 1),  # attention norm
            (m.dim, 1),  # mlp norm
        ]
        if m.qkv_bias:
            block += [(m.n_heads * hd // tp, 1), (kv_rows, 1), (kv_rows, 1)]
        if m.qk_norm:
            block += [(hd, 1), (hd, 1)]
        if m.sandwich_norms:
            block += [(m.dim, 1), (m.dim, 1)]
        block_bytes = sum(pad(r, dp) * c for r, c in block) * F32
        heads = 1 if m.tie_embeddings else 2
        root_bytes = (heads * pad(m.vocab_size // tp, dp) * m.dim + pad(m.dim, dp)) * F32
        gathers = 2 * m.n_layers - 1 + 1
        out["fsdp_all_gather"] = (
            gathers * n_micro,
            ((2 * m.n_layers - 1) * block_bytes + root_bytes) * n_micro,
        )
        out["fsdp_reduce_scatter"] = (
            (m.n_layers + 1) * n_micro,
            (m.n_layers * block_bytes + root_bytes) * n_micro,
        )
    if dp * tp > 1:
        # The squared global grad norm (float64) over the world; with dp > 1 also the global
        # batch's loss-token and real-token counts and attended (query, key) pairs (three int64,
        # one all-reduce) and the logged loss (fp32) over dp.
        out["scalar_all_reduce"] = (3, 8 + 3 * 8 + F32) if dp > 1 else (1, 8)
    return out


CASES = [
    (2, 2, 0, None),
    (2, 2, 2, None),
    (1, 2, 0, None),
    (2, 1, 0, None),
    (2, 2, 0, ALL_SWITCHES_KV1),
]


@pytest.mark.parametrize(
    "dp,tp,micro,model", CASES, ids=["2x2", "2x2-micro", "1x2", "2x1", "2x2-all-switches-kv1"]
)
def test_counts_and_bytes_equal_formula(tmp_path, dp, tp, micro, model):
    out = tmp_path / "comm.json"
    args = ["tests/workers/comm.py", str(out), str(dp), str(tp), str(micro)]
    check_ok(run_ranks(dp * tp, args + ([json.dumps(model)] if model else [])))
    measured = json.loads(out.read_text())
    # Every collective CommDebugMode saw is one the report knows and filed under its kind.
    unknown = {op: n for op, n in measured["by_op"].items() if op not in OP_KIND}
    assert not unknown, f"collectives the report cannot classify: {unknown}"
    by_kind = {}
    for op, n in measured["by_op"].items():
        by_kind[OP_KIND[op]] = by_kind.get(OP_KIND[op], 0) + n
    assert by_kind == measured["counts"], measured
    want = expected(dp, tp, micro, model)
    assert measured["counts"] == {k: c for k, (c, _) in want.items()}, (measured, want)
    assert measured["bytes"] == {k: b for k, (_, b) in want.items()}, (measured, want)
    # The planner's prediction is the same, its scalar all-reduces (count and bytes) included.
    assert measured["analytic"] == {k: list(v) for k, v in want.items()}
