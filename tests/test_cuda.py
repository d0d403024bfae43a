"""What only a CUDA device runs, against references on the same device (tools/gpu_check.sh runs
this file on a lent GPU; without one every test skips):

- the FlexAttention path (models/attention.py on CUDA: a BlockMask and the compiled
  flex_attention) against SDPA with the dense boolean mask, forward and backward, for document
  masks, a sliding window and both;
- a Gemma 3-like model (sliding layers through that path, two RoPE bases, sandwich norms) and a
  Qwen3-like one (q/k norms, head_dim != dim / heads) against transformers, and Gemma 3's packed
  rows against each document alone;
- one LoRA step (adapters' loss, gradients and update) against PEFT.

fp32 throughout with TF32 off, so the tolerances are those of a different summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid2d.models.attention import BlockMask, attend, build_mask, dense_mask
from hybrid2d.models.llama import Llama
from hybrid2d.parallel.lora import is_adapter

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh runs it)"
)
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def documents(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths_per_row]
    return torch.stack(rows).to(CUDA)


# Rows of 384 positions: FlexAttention's 128-blocks, a document boundary on one (whole blocks
# masked) and others inside blocks (partial blocks), a row of one document.
DOCS = [[128, 37, 219], [384]]


@pytest.mark.parametrize(
    "window, with_documents", [(0, True), (100, False), (100, True)], ids=["docs", "win", "both"]
)
def test_flex_block_mask_equals_sdpa_with_the_dense_mask(window, with_documents):
    torch.manual_seed(0)
    b, h, kv, s, d = 2, 8, 2, 384, 64
    q, k, v = (torch.randn(b, n, s, d, device=CUDA, requires_grad=True) for n in (h, kv, kv))
    docs = documents(DOCS) if with_documents else None
    mask = build_mask(docs, window, s, CUDA)
    assert isinstance(mask, BlockMask)  # the CUDA path, not the dense mask
    got = attend(q, k, v, mask, scale=0.125)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    dense = dense_mask(docs, window, s, CUDA)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.125, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=f"d{name}")


def ours_from(hf) -> Llama:
    from tests.test_families import ours_from_hf

    return ours_from_hf(hf).to(CUDA).eval()


def make_hf(family: str):
    """tests/test_families.py's tiny model of the family with head_dim 16: FlexAttention's
    kernels take the power-of-two head sizes real models have (Gemma 3: 256, Qwen3: 128)."""
    from tests.test_families import make_hf

    return make_hf(family, head_dim=16)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_family_logits_equal_transformers_on_cuda(family):
    pytest.importorskip("transformers")
    from tests.test_families import TOKENS

    hf = make_hf(family).to(CUDA)
    model = ours_from(hf)
    tokens = TOKENS.to(CUDA)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_gemma3_packed_rows_equal_each_document_alone_on_cuda():
    """Document masks and restarting positions through the compiled kernel, with Gemma 3's
    sliding layers: a packed row's logits are those of its documents run alone."""
    pytest.importorskip("transformers")
    from tests.test_families import VOCAB

    model = ours_from(make_hf("gemma3"))
    lengths = [7, 12, 3, 10]
    tokens = torch.randint(0, VOCAB, (1, sum(lengths)), device=CUDA)
    with torch.no_grad():
        packed = model(tokens, documents([lengths]))
        alone = [model(part) for part in tokens.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-4, atol=1e-4)


def test_a_lora_step_equals_peft_on_cuda():
    pytest.importorskip("peft")
    from tests.lora_reference import (
        lora_job,
        lora_settings,
        mean_loss,
        odd_model,
        ours,
        peft_adapters,
        peft_twin,
        randomize_b,
    )
    from tests.reference import global_batches

    lcfg = lora_settings()
    model = randomize_b(ours(odd_model(), lcfg, seed=3))
    twin = peft_twin(model, lcfg).to(CUDA)
    model = model.to(CUDA)
    job = lora_job(odd_model(), lcfg, steps=1)
    inputs, labels = (t.to(CUDA) for t in next(global_batches(job)))
    mine = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    theirs = peft_adapters(twin)
    losses = []
    forwards = (lambda: model(inputs), lambda: twin(input_ids=inputs).logits)
    for params, forward in zip((mine, theirs), forwards, strict=True):
        opt = torch.optim.SGD(params.values(), lr=job.train.lr)
        loss = mean_loss(forward(), labels)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert sorted(mine) == sorted(theirs)
    for name, p in theirs.items():
        torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(mine[name], p, rtol=1e-5, atol=1e-6, msg=name)
    frozen = [n for n, p in model.named_parameters() if not is_adapter(n) and p.grad is not None]
    assert not frozen, frozen
