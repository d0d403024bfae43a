"""The TP plan and activation checkpointing are applied from outside: HF names unchanged, every
weight placed as the plan says, and the model's own code untouched (one process, fake group)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybrid2d.config import ModelConfig
from hybrid2d.models.llama import Attention, Llama, RMSNorm
from hybrid2d.parallel.activation_checkpoint import apply_ac
from hybrid2d.parallel.tensor_parallel import (
    ColumnParallelLinear,
    HeadRMSNorm,
    KVHeadLinear,
    SequenceParallelRMSNorm,
    apply_tp,
    tp_plan,
)

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)


@contextlib.contextmanager
def fake_tp_mesh(rank: int, size: int):
    """Rank `rank` of a tp mesh over PyTorch's fake process group (no peers needed; collectives
    return garbage, so only what needs none is checked)."""
    # torch.testing's FakeStore: a test-only store, no public one serves a fake group.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tp_mesh():
    """Rank 0 of a 2-rank tp mesh."""
    with fake_tp_mesh(0, 2) as mesh:
        yield mesh


def meta_model(cfg=CFG) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def test_plan_keeps_names_and_places_every_weight(tp_mesh):
    model = meta_model()
    names = [n for n, _ in model.named_parameters()]
    apply_tp(model, tp_mesh)
    assert [n for n, _ in model.named_parameters()] == names
    expected = {
        "model.embed_tokens.weight": Shard(0),
        "input_layernorm.weight": Replicate(),
        "q_proj.weight": Shard(0),
        "k_proj.weight": Shard(0),
        "v_proj.weight": Shard(0),
        "o_proj.weight": Shard(1),
        "post_attention_layernorm.weight": Replicate(),
        "gate_proj.weight": Shard(0),
        "up_proj.weight": Shard(0),
        "down_proj.weight": Shard(1),
        "model.norm.weight": Replicate(),
        "lm_head.weight": Shard(0),
    }
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        want = next(v for k, v in expected.items() if name.endswith(k))
        assert p.placements == (want,), (name, p.placements)
    # The model's classes are only extended: an Attention is still an Attention.
    block = model.model.layers[0]
    assert isinstance(block.self_attn, Attention) and isinstance(block.input_layernorm, RMSNorm)
    assert type(block.self_attn) is Attention  # styled through its input hook, not its class


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_past_the_kv_heads_each_rank_computes_its_query_heads_kv_head(rank):
    """tp 4, 8 query heads, 2 kv heads: ranks 0-1 hold queries 0-3 (kv head 0), ranks 2-3
    queries 4-7 (kv head 1). k/v stay whole DTensors (HF's shape, replicated over tp); a rank's
    k_proj output is exactly its kv head's rows of the full projection."""
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=128)
    model = Llama(cfg)
    model.init_weights(0)
    full_k = model.model.layers[0].self_attn.k_proj.weight.detach().clone()
    x = torch.randn(2, 5, cfg.dim)
    with fake_tp_mesh(rank, 4) as mesh:
        apply_tp(model, mesh)
        attn = model.model.layers[0].self_attn
        for proj in (attn.k_proj, attn.v_proj):
            assert proj.weight.placements == (Replicate(),)
            assert proj.weight.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.dim)
        assert attn.q_proj.weight.placements == (Shard(0),)
        hd, head = cfg.head_dim, rank // 2
        torch.testing.assert_close(attn.k_proj(x), F.linear(x, full_k[head * hd : (head + 1) * hd]))


def test_the_plan_of_each_family_is_data():
    """The switches add entries (q/k norms, Gemma 3's second pair of norms), nothing else."""
    llama = ModelConfig()
    qwen3 = ModelConfig(family="qwen3", qk_norm=True, qkv_bias=True, n_kv_heads=2)
    gemma = ModelConfig(family="gemma3", qk_norm=True, sandwich_norms=True, norm_plus_one=True)
    base, q3, g3 = tp_plan(llama), tp_plan(qwen3), tp_plan(gemma)
    added = {k.removeprefix("model.layers.*.") for k in set(q3) - set(base)}
    assert added == {"self_attn.q_norm", "self_attn.k_norm"}
    assert all(isinstance(q3[f"model.layers.*.{k}"], HeadRMSNorm) for k in added)
    added = {k.removeprefix("model.layers.*.") for k in set(g3) - set(q3)}
    assert added == {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
    assert all(isinstance(g3[f"model.layers.*.{k}"], SequenceParallelRMSNorm) for k in added)
    assert isinstance(q3["model.layers.*.self_attn.q_proj"], ColumnParallelLinear)
    kv = q3["model.layers.*.self_attn.k_proj"]
    assert isinstance(kv, KVHeadLinear) and kv.max_shards == 2  # past 2 ranks: replicated


@pytest.mark.parametrize("tp", [4, 8])
def test_a_tp_that_neither_divides_nor_is_a_multiple_of_the_kv_heads_is_refused(tp):
    with fake_tp_mesh(0, tp) as mesh:
        model = meta_model(ModelConfig(**{**CFG.__dict__, "n_heads": 24, "n_kv_heads": 6}))
        with pytest.raises(ValueError, match=f"tp={tp} neither divides nor is a multiple of 6"):
            apply_tp(model, mesh)


def test_tied_embeddings_share_one_sharded_weight(tp_mesh):
    model = meta_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    apply_tp(model, tp_mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.placements == (Shard(0),)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_names_and_values(mode):
    torch.manual_seed(0)
    ref = Llama(CFG)
    ref.init_weights(0)
    model = Llama(CFG)
    model.load_state_dict(ref.state_dict())
    apply_ac(model, mode)
    assert list(model.state_dict()) == list(ref.state_dict())
    # MLP calls: backward enters them again when blocks are checkpointed (a pre-hook: the
    # recomputation stops early, inside the MLP, once it has what backward needs).
    calls = []
    for m in (ref, model):
        for block in m.model.layers:
            block.mlp.register_forward_pre_hook(lambda mod, args, m=m: calls.append(m))
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    ref(tokens).sum().backward()
    model(tokens).sum().backward()
    assert calls.count(ref) == CFG.n_layers
    assert calls.count(model) == 2 * CFG.n_layers  # recomputed in backward
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_unknown_checkpointing_mode_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        apply_ac(Llama(CFG), "sometimes")
