"""The unparallelised model against HF transformers' LlamaForCausalLM (the reference)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybrid2d.config import ModelConfig  # noqa: E402
from hybrid2d.models.llama import Llama  # noqa: E402

CASES = {
    "gqa-llama3-rope": dict(kv=2, tie=False, llama3=True),
    "tied-embeddings": dict(kv=8, tie=True, llama3=False),
}


def hf_and_ours(kv: int, tie: bool, llama3: bool):
    rope = (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        if llama3
        else {"rope_type": "default", "rope_theta": 10000.0}
    )
    hc = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv,
        vocab_size=128,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hc).eval()
    ours = Llama(
        ModelConfig(
            dim=64,
            n_layers=2,
            n_heads=8,
            n_kv_heads=kv,
            ffn_dim=96,
            vocab_size=128,
            norm_eps=1e-5,
            tie_embeddings=tie,
            rope_theta=rope["rope_theta"],
            rope_scaling_factor=8.0 if llama3 else 0.0,
            rope_original_max_position=16,
        )
    )
    # No mapping: HF's state dict loads as is.
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_hf(case):
    hf, ours = hf_and_ours(**CASES[case])
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_keys_and_shapes_equal_hf(case):
    hf, ours = hf_and_ours(**CASES[case])
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == theirs


def test_llama3_inv_freq_equals_hf():
    hf, ours = hf_and_ours(**CASES["gqa-llama3-rope"])
    torch.testing.assert_close(ours.inv_freq, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)


def test_tied_embedding_is_one_parameter():
    _, ours = hf_and_ours(**CASES["tied-embeddings"])
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
