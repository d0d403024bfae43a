"""The TP plan and activation checkpointing are applied from outside: HF names unchanged, every
weight placed as the plan says, and the model's own code untouched (one process, fake group)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybrid2d.config import ModelConfig
from hybrid2d.models.llama import Attention, Llama, RMSNorm
from hybrid2d.parallel.activation_checkpoint import apply_ac
from hybrid2d.parallel.tensor_parallel import apply_tp

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)


@pytest.fixture
def tp_mesh():
    """Rank 0 of a 2-rank tp mesh over PyTorch's fake process group (no peers needed)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


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
