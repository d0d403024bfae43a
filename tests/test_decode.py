"""The KV-cache decoder (hybrid2d/decode.py) against the model's one forward path, and
tools/generate.py's sampling through it against the full-recompute loop it replaced."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from hybrid2d.decode import Decoder
from hybrid2d.models.llama import Llama
from tests.launch import REPO
from tests.reference import tiny_config
from tests.test_imports import GRAPH


def _generate_module():
    spec = importlib.util.spec_from_file_location("gen", REPO / "tools" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_llama(tied: bool, seed: int = 0) -> Llama:
    """fp32, GQA (4 heads over 2 kv heads), llama3 RoPE scaling that bites within 64 positions."""
    cfg = dataclasses.replace(
        tiny_config().model,
        n_heads=4,
        n_kv_heads=2,
        max_position_embeddings=128,
        tie_embeddings=tied,
    )
    assert cfg.rope_scaling_factor == 8.0 and cfg.rope_original_max_position == 16
    torch.manual_seed(seed)
    model = Llama(cfg)
    # Block matrices 10x init_std, so that logits are far from uniform, positions matter and greedy
    # decoding (tied ones too) does not just repeat the last token.
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and name.startswith("model.layers."):
                p.mul_(10.0)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_cached_logits_equal_full_forward_at_every_position(tied):
    model = tiny_llama(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=gen)
    prompt = 7
    with torch.no_grad():
        full = model(tokens)
    dec = Decoder(model, capacity=tokens.shape[1])
    parts = [dec.prefill(tokens[:, :prompt])]
    parts += [dec.step(tokens[:, t : t + 1]) for t in range(prompt, tokens.shape[1])]
    cached = torch.cat(parts, dim=1)
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    # The test can fail: a step at the wrong position (RoPE) is far off.
    wrong = Decoder(model, capacity=tokens.shape[1])
    wrong.prefill(tokens[:, : prompt - 1])
    off = wrong.step(tokens[:, prompt : prompt + 1])
    assert (off - full[:, prompt : prompt + 1]).abs().max() > 1e-2


def test_decoder_refuses_misuse():
    model = tiny_llama(tied=False)
    dec = Decoder(model, capacity=4)
    with pytest.raises(ValueError, match="before prefill"):
        dec.step(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="capacity is 4"):
        dec.prefill(torch.tensor([[1, 2, 3, 4, 5]]))
    dec.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="one token"):
        dec.step(torch.tensor([[1, 2]]))
    dec.step(torch.tensor([[4]]))
    with pytest.raises(ValueError, match="full"):
        dec.step(torch.tensor([[5]]))


def recompute_greedy(model, ids, max_new_tokens, max_context=None):
    """The loop tools/generate.py had before the KV cache: the whole context for every token."""
    context = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = context[-max_context:] if max_context else context
            context.append(int(torch.argmax(model(torch.tensor([window]))[0, -1])))
    return context[len(ids) :]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("max_context", [None, 128, 20])  # 20: the window slides
def test_greedy_sample_equals_full_recompute(tied, max_context):
    gen_py = _generate_module()
    model = tiny_llama(tied, seed=2)
    ids = torch.randint(0, model.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    new = gen_py.sample(model, ids, 32, max_context=max_context)
    assert new == recompute_greedy(model, ids, 32, max_context)
    assert len(set(new)) > 3  # not a degenerate repeat of one token


def test_sampling_with_temperature_equals_full_recompute():
    """Same logits, same generator: the sampled ids match those of a plain callable model."""
    gen_py = _generate_module()
    model = tiny_llama(tied=False, seed=4)
    ids = [5, 17, 42]
    cached = gen_py.sample(model, ids, 24, temperature=0.9, top_k=20, seed=11)
    plain = gen_py.sample(lambda t: model(t), ids, 24, temperature=0.9, top_k=20, seed=11)
    assert cached == plain
    # A stop token ends both where it first appears.
    stop = cached[5]
    assert (
        gen_py.sample(model, ids, 24, 0.9, 20, 11, stop_id=stop) == cached[: cached.index(stop) + 1]
    )


def test_tokens_through_the_layers_grow_linearly():
    """A count, not a time: 32 new tokens after a prompt run prompt + 32 - 1 token positions
    through a layer with the cache, against the sum of all context lengths without it."""
    gen_py = _generate_module()
    model = tiny_llama(tied=False, seed=5)
    seen = []
    hook = model.model.layers[0].mlp.register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[1])
    )
    prompt, new = 10, 32
    ids = list(range(1, prompt + 1))
    try:
        out = gen_py.sample(model, ids, new)
        assert len(out) == new
        assert sum(seen) == prompt + new - 1
        assert seen == [prompt] + [1] * (new - 1)
        seen.clear()
        recompute_greedy(model, ids, new)
        assert sum(seen) == sum(range(prompt, prompt + new))  # what the cache saves
    finally:
        hook.remove()


def test_decode_imports_only_models_and_config():
    imported = {target.split(".")[1] for target, _ in GRAPH["hybrid2d.decode"]}
    assert imported <= {"models", "config"}, imported
