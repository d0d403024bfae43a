"""Every supported family against HF transformers (the reference), one process.

Each family is a tiny random model transformers itself builds and saves, with odd shapes: GQA,
head_dim != hidden / heads (Mistral, Qwen3, Gemma 3), q/k/v biases (Qwen2), tied and untied
embeddings, sliding windows shorter than the test sequence (Mistral, Qwen2, Gemma 3, whose
layer_types mix both kinds and whose local layers have their own RoPE base), linear RoPE scaling
(Gemma 3). Checked: logits through the `hf:` load path, HF -> DCP -> HF bit for bit, the
config.json we export loading as the same class, greedy generation, and refused configs.
"""

import glob
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from hybrid2d.checkpoint.hf import (  # noqa: E402
    CheckpointError,
    hf_config_from_model,
    load_pretrained,
    model_config_from_hf,
)
from hybrid2d.checkpoint.hf_convert import convert_dcp_to_hf, convert_hf_to_dcp  # noqa: E402
from hybrid2d.decode import Decoder  # noqa: E402
from hybrid2d.models.llama import Llama  # noqa: E402

VOCAB = 97
SHAPE = dict(
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
# family -> (config class, model class, its settings beyond SHAPE)
FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(head_dim=10, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
             "rope_theta": 5e4}),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(head_dim=10, sliding_window=5, rope_parameters={"rope_type": "default",
             "rope_theta": 1e4}),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
             max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=12, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
             "rope_theta": 1e6}),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=20,
            query_pre_attn_scalar=24,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        ),
    ),
}  # fmt: skip
TOKENS = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))


def make_hf(family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():  # norms start at 1 (or 0), biases at 0: make every weight count
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF directory, the transformers model saved there)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        model = make_hf(family)
        model.save_pretrained(root / family)
        out[family] = (str(root / family), model)
    return out


def load_ours(spec: str, path: str) -> Llama:
    with open(os.path.join(path, "config.json")) as f:
        cfg = model_config_from_hf(json.load(f))
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_pretrained(model, spec)
    return model.eval()


def tensors(path: str) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_hf(saved, family):
    path, hf = saved[family]
    ours = load_ours(f"hf:{path}", path)
    assert ours.cfg.family == family
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in hf.state_dict().items()
    }
    with torch.no_grad():
        expected, got = hf(TOKENS).logits, ours(TOKENS)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_dcp_hf_is_bit_identical_and_export_loads_as_the_class(saved, family, tmp_path):
    path, hf = saved[family]
    convert_hf_to_dcp(path, str(tmp_path / "dcp"), progress=False)
    convert_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "back"), progress=False)
    before, after = tensors(path), tensors(str(tmp_path / "back"))
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert t.dtype == after[name].dtype and torch.equal(t, after[name]), name
    # The config.json we write for a model of this family (a training run's export) loads in
    # transformers as the same class, with the same logits, and reads back as the same config.
    cfg = model_config_from_hf(json.load(open(os.path.join(path, "config.json"))))
    with open(tmp_path / "back" / "config.json", "w") as f:
        json.dump(hf_config_from_model(cfg), f)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(theirs) is type(hf)
    assert model_config_from_hf(theirs.config.to_dict()) == cfg
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, hf(TOKENS).logits, rtol=0, atol=0)
    ours = load_ours(f"dcp:{tmp_path / 'dcp'}", path)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_hf(saved, family):
    path, hf = saved[family]
    ours = load_ours(f"hf:{path}", path)
    prompt, new = TOKENS[:1, :4], 14  # 18 positions: past every sliding window
    expected = hf.generate(
        prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0
    )[0, 4:].tolist()
    dec = Decoder(ours, capacity=4 + new)
    got = []
    logits = dec.prefill(prompt)
    for _ in range(new):
        got.append(int(logits[0, -1].argmax()))
        logits = dec.step(torch.tensor([[got[-1]]]))
    assert got == expected
    # The cache's logits equal the full forward's at every position (windows included).
    with torch.no_grad():
        full = ours(torch.cat([prompt, torch.tensor([got])], dim=1))
    dec.prefill(prompt)
    for i, tok in enumerate(got[:-1]):
        step = dec.step(torch.tensor([[tok]]))
        torch.testing.assert_close(step[0, -1], full[0, 4 + i], rtol=1e-5, atol=1e-5)


def hf_config(family: str) -> dict:
    config_cls, _, extra = FAMILIES[family]
    data = config_cls(**SHAPE, **extra).to_dict()
    data["architectures"] = [FAMILIES[family][1].__name__]
    return data


@pytest.mark.parametrize(
    "family,change,message",
    [
        ("llama", {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
         "unsupported architecture MixtralForCausalLM; supported: LlamaForCausalLM, "
         "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM"),
        ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
         "unsupported architecture Gemma3ForConditionalGeneration; supported: "),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not "
         "supported for Gemma3ForCausalLM"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
        ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
         "layer_types=.* must name each of the 3 layers full_attention or sliding_attention"),
        ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default",
         "rope_theta": 1e6}, "sliding_attention": {"rope_type": "linear", "factor": 2.0,
         "rope_theta": 1e4}}}, "sliding_attention rope type 'linear' is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported for "
         "Qwen3ForCausalLM"),
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
         "rope_parameters rope type 'yarn' is not supported"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention", "full_attention"],
         "use_sliding_window": False}, "layer_types has sliding_attention layers but "
         "use_sliding_window is false"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("mistral", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported for LlamaForCausalLM"),
        ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
         "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5 is not supported"),
    ],
)  # fmt: skip
def test_refused_with_one_line_naming_the_field(family, change, message):
    data = hf_config(family) | change
    with pytest.raises(CheckpointError, match=message) as e:
        model_config_from_hf(data)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_transformers_4_window_and_rope_keys_read_the_same(family):
    """Older config.json files: Qwen's layer kinds from max_window_layers only, Gemma 3's from
    sliding_window_pattern and its RoPE from rope_theta / rope_local_base_freq / rope_scaling."""
    new = hf_config(family)
    old = dict(new)
    old.pop("layer_types")
    if family == "gemma3":
        old.pop("rope_parameters")
        old |= {
            "sliding_window_pattern": 2,  # layers 1 and 3 slide, 2 is global
            "rope_theta": 1e5,
            "rope_local_base_freq": 1e3,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }
    assert model_config_from_hf(old) == model_config_from_hf(new)
