"""LoRA (parallel/lora.py) against PEFT over transformers, the independent reference."""

import pytest
import torch

pytest.importorskip("peft")

from hybrid2d.config import JobConfig, LoraConfig  # noqa: E402
from hybrid2d.errors import ConfigError  # noqa: E402
from hybrid2d.models.llama import Llama  # noqa: E402
from hybrid2d.parallel.lora import apply_lora, is_adapter  # noqa: E402
from tests.launch import check_ok, run_ranks  # noqa: E402
from tests.lora_reference import (  # noqa: E402
    batches,
    lora_job,
    lora_settings,
    mean_loss,
    odd_model,
    ours,
    peft_adapters,
    peft_twin,
    tp4_model,
    train_peft,
)


def train_ours(model, data, lr):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, grads = [], None
    for inputs, labels in data:
        loss = mean_loss(model(inputs), labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("targets", ["all-linear", "q_proj, v_proj,down_proj"])
def test_single_process_equals_peft(targets):
    """Logits, loss, adapter gradients and the adapters after 10 SGD steps equal PEFT's (fp32),
    and the frozen base is bit-identical after training."""
    lcfg = lora_settings(targets=targets)
    model = ours(odd_model(), lcfg, seed=3)
    with torch.no_grad():  # B = 0 at first: make it random, or A's gradient is zero
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    twin = peft_twin(model, lcfg)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    job = lora_job(odd_model(), lcfg)
    data = list(batches(job))
    tokens = data[0][0]
    torch.testing.assert_close(model(tokens), twin(input_ids=tokens).logits, rtol=1e-5, atol=1e-6)

    got_losses, got_grads = train_ours(model, data, job.train.lr)
    ref = train_peft(twin, data, job.train.lr)
    assert sorted(got_grads) == sorted(ref["grads"])  # only the adapters are trained
    torch.testing.assert_close(got_losses, ref["losses"], rtol=1e-5, atol=0)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    for name, p in ref["adapters"].items():
        torch.testing.assert_close(adapters[name], p, rtol=1e-5, atol=1e-7, msg=name)
    for name, p in model.named_parameters():
        if not is_adapter(name):
            assert torch.equal(p, base[name]), f"{name} changed"
            assert p.grad is None, f"{name} has a gradient"


def test_bf16_base_with_fp32_adapters_equals_peft():
    """A bf16 base: activations in bf16, adapters computed and kept in fp32, as PEFT does."""
    lcfg = lora_settings(base_dtype="bf16")
    model = ours(odd_model(), lcfg, seed=5)
    assert {p.dtype for n, p in model.named_parameters() if is_adapter(n)} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if not is_adapter(n)} == {torch.bfloat16}
    twin = peft_twin(model, lcfg)
    job = lora_job(odd_model(), lcfg, steps=3)
    data = list(batches(job))
    losses, _ = train_ours(model, data, job.train.lr)
    ref = train_peft(twin, data, job.train.lr)
    # The first forward is the same arithmetic; after it the bf16 backward of the two
    # implementations rounds differently (at bf16's 4e-3 precision), so the bound is bf16's.
    assert abs(losses[0] - ref["losses"][0]) <= 1e-5 * ref["losses"][0]
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-3, atol=0)
    mine = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    for name, p in peft_adapters(twin).items():
        torch.testing.assert_close(mine[name], p, rtol=2e-2, atol=2e-3, msg=name)


def test_bad_settings_are_one_line():
    cfg = JobConfig()
    cfg.lora.rank, cfg.lora.targets = 4, "q_proj,qproj"
    with pytest.raises(ConfigError, match=r"^lora\.targets='q_proj,qproj': 'qproj' matches no"):
        cfg.check_settings()
    cfg.lora.targets = "lm_head"
    with pytest.raises(ConfigError, match="matches no layer of a block"):
        cfg.check_settings()
    cfg.lora.targets = "q_proj"
    cfg.check_settings()
    model = Llama(odd_model())
    with pytest.raises(ConfigError, match=r"^lora\.rank=31 is larger than .*use a rank <= 10"):
        apply_lora(model, LoraConfig(rank=31, targets="all-linear"))
    with pytest.raises(ConfigError, match="lora.rank=-1 is out of range"):
        cfg.lora.rank = -1
        cfg.check_settings()


def test_rank_zero_changes_nothing():
    model = Llama(odd_model())
    before = dict(model.named_parameters())
    apply_lora(model, LoraConfig(rank=0))
    assert dict(model.named_parameters()) == before
    assert all(p.requires_grad for p in model.parameters())


def peft_reference(base_dtype: str) -> tuple[dict, dict]:
    """PEFT's 10 SGD steps from the trainer's own initial state, and that base."""
    lcfg = lora_settings(base_dtype=base_dtype)
    job = lora_job(tp4_model(), lcfg)
    model = ours(tp4_model(), lcfg, seed=job.train.seed)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    return train_peft(peft_twin(model, lcfg), list(batches(job)), job.train.lr), base


@pytest.mark.slow
def test_meshes_equal_single_process_peft(tmp_path):
    """One 4-rank launch trains (2, 2), (1, 4) and (4, 1), fp32 base: losses, last-step adapter
    gradients and final adapters equal PEFT's to 1e-5; the base is bit-identical and has no
    gradient; the optimizer holds the adapters only."""
    out = tmp_path / "lora.pt"
    check_ok(run_ranks(4, ["tests/workers/lora_parity.py", str(out), "fp32", "2x2", "1x4", "4x1"]))
    got = torch.load(out)
    ref, base = peft_reference("fp32")
    n_adapters = sum(p.numel() for p in ref["adapters"].values())
    for mesh, res in got.items():
        assert res["grad_names"] == sorted(ref["grads"]), mesh
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=1e-5, atol=0, msg=mesh)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(res["grads"][name], g, rtol=1e-5, atol=1e-7, msg=mesh + name)
        for name, p in ref["adapters"].items():
            torch.testing.assert_close(
                res["adapters"][name], p, rtol=1e-5, atol=1e-7, msg=mesh + name
            )
        for name, p in base.items():
            assert torch.equal(res["base"][name], p), f"{mesh}: {name} changed"
    # The optimizer holds this rank's shards of the adapters only (sum over a dp x tp mesh of
    # local numels would need padding rules; the whole adapter count bounds it).
    assert all(0 < res["trainable"] <= n_adapters for res in got.values())
