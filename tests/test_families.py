"""Every supported family against HF transformers (the reference), one process.

Each family is a tiny random model transformers itself builds and saves, with odd shapes: GQA,
head_dim != hidden / heads (Mistral, Qwen3, Gemma 3), q/k/v biases (Qwen2), tied and untied
embeddings, sliding windows shorter than the test sequence (Mistral, Qwen2, Gemma 3, whose
layer_types mix both kinds and whose local layers have their own RoPE base), linear RoPE scaling
(Gemma 3). Checked: logits through the `hf:` load path, HF -> DCP -> HF bit for bit, the
config.json we export loading as the same class, greedy generation, and refused configs.
"""

import dataclasses
import glob
import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from hybrid2d.checkpoint.hf import (  # noqa: E402
    CheckpointError,
    check_model_config,
    hf_config_from_model,
    load_pretrained,
    model_config_from_hf,
)
from hybrid2d.checkpoint.hf_convert import convert_dcp_to_hf, convert_hf_to_dcp  # noqa: E402
from hybrid2d.checkpoint.standalone import Source, load_model  # noqa: E402
from hybrid2d.data.tokenizer import leading_special_ids  # noqa: E402
from hybrid2d.data.tokens import encode_documents  # noqa: E402
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


def make_hf(family: str, **changes):
    """The family's tiny transformers model (its config's fields `changes` changed), every
    weight random."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **(extra | changes))).eval()
    with torch.no_grad():  # norms start at 1 (or 0), biases at 0: make every weight count
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def ours_from_hf(hf) -> Llama:
    """Our model of a transformers model's config, holding its weights."""
    model = Llama(model_config_from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)  # a tied head is absent
    model.tie_weights()
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
    ours, _ = load_model(Source(Path(path), "hf"))  # what tools/generate.py runs
    prompt, new = TOKENS[:1, :4], 14  # 18 positions: past every sliding window
    expected = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # no position is padding, whatever its id
        max_new_tokens=new,
        min_new_tokens=new,  # which suppresses EOS, as the loop below does
        do_sample=False,
        pad_token_id=0,
    )[0, 4:].tolist()
    eos = hf.generation_config.eos_token_id
    dec = Decoder(ours, capacity=4 + new)
    got = []
    logits = dec.prefill(prompt)
    for _ in range(new):
        if eos is not None:
            logits[..., eos] = float("-inf")
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
        ("qwen2", {"quantization_config": {"quant_method": "awq", "bits": 4}},
         "quantization_config is set \\(quant_method 'awq'\\); hybrid2d loads and trains "
         "unquantized weights"),
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


# ---- tokenization: documents start as the family's tokenizer starts a text ------------------

# family -> (BOS its post-processor adds or None, EOS): each family's tokenizer.json in miniature.
TOKENIZERS = {
    "llama": ("<|begin_of_text|>", "<|end_of_text|>"),
    "mistral": ("<s>", "</s>"),
    "qwen": (None, "<|endoftext|>"),
    "gemma3": ("<bos>", "<eos>"),
}
TEXTS = ["The cat sat on the mat.", "A second document, with digits 12345.", "x"]


def family_tokenizer(family: str):
    bos, eos = TOKENIZERS[family]
    specials = [t for t in (bos, eos) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 4, trainer)
    if bos is None:  # Qwen: the byte-level processor, which adds nothing
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


@pytest.mark.parametrize("family", list(TOKENIZERS))
def test_documents_start_with_the_bos_transformers_adds(family):
    tok = family_tokenizer(family)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    eos = tok.token_to_id(TOKENIZERS[family][1])
    expected = [i for text in TEXTS for i in [*theirs(text)["input_ids"], eos]]
    assert encode_documents(iter(TEXTS), tok).tolist() == expected
    bos = TOKENIZERS[family][0]
    assert leading_special_ids(tok) == ([] if bos is None else [tok.token_to_id(bos)])


def test_init_weights_starts_norms_and_biases_as_hf_does(saved):
    """Gemma's (1 + w) norms start at 0, the others at 1; Qwen2's biases at 0 (as HF's
    `_init_weights`); the projections are random."""
    for family in ("gemma3", "qwen2"):
        with open(os.path.join(saved[family][0], "config.json")) as f:
            cfg = model_config_from_hf(json.load(f))
        model = Llama(cfg)
        model.init_weights(seed=3)
        start = 0.0 if family == "gemma3" else 1.0
        norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
        assert len(norms) == cfg.n_layers * (6 if family == "gemma3" else 2) + 1
        assert all(bool((p == start).all()) for p in norms.values())
        biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
        assert len(biases) == (3 * cfg.n_layers if family == "qwen2" else 0)
        assert all(bool((p == 0).all()) for p in biases)
        assert model.model.layers[0].self_attn.q_proj.weight.std() > 0.01


def test_gemma3_bf16_logits_equal_hf():
    """In bf16 too: the embedding scale is rounded to bf16 before the multiply, and the (1 + w)
    norms compute in fp32 then cast, as HF does."""
    hf = make_hf("gemma3").to(torch.bfloat16)
    cfg = model_config_from_hf(hf.config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    ours = Llama(cfg)
    ours.load_state_dict(hf.state_dict())
    ours = ours.to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, rtol=0, atol=0)


def test_a_shape_setting_that_differs_from_the_checkpoint_names_its_setting():
    cfg = model_config_from_hf(hf_config("qwen3"))
    other = dataclasses.replace(cfg, attn_head_dim=8)
    with pytest.raises(CheckpointError, match="config.json head_dim=12 but model.head_dim=8; "
                       "set --model.attn_head_dim 12"):  # fmt: skip
        check_model_config(cfg, other, "hf:q", "config.json")
    gemma = model_config_from_hf(hf_config("gemma3"))
    with pytest.raises(CheckpointError, match="layer_types=SFS but model.layer_types=SSS"):
        check_model_config(gemma, dataclasses.replace(gemma, layer_types="SSS"), "hf:g", "x")


# config.json files as the Hub holds them (transformers-4 keys: rope_theta, rope_scaling,
# rope_local_base_freq, sliding_window_pattern, use_sliding_window without layer_types).
PUBLISHED = {
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "initializer_range": 0.02, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 262144,
    },
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_transformers_reads_them(name, tmp_path):
    """A Hub config.json reads the same whether we read it or transformers first rewrites it
    (its layer types, windows and RoPE per layer type), and the model it describes has
    transformers' parameter shapes (built on the meta device: no memory)."""
    raw = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    cfg = model_config_from_hf(raw)
    assert model_config_from_hf(theirs.to_dict() | {"architectures": raw["architectures"]}) == cfg
    if name == "gemma-3-1b-it":
        assert cfg.layer_types == ("SSSSSF" * 5)[:26] and cfg.sliding_window == 512
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.head_dim) == (1e6, 1e4, 256)
    with torch.device("meta"):
        ours = Llama(cfg)
        hf = transformers.AutoModelForCausalLM.from_config(theirs)
    assert type(hf).__name__ == raw["architectures"][0]
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in hf.state_dict().items()
    }
