"""Packed rows are exact: on (2,2), (1,4) and (4,1) with micro batch 1 and 2, the first step's
gradients, each step's loss and grad norm, the final parameters (SGD with clipping) and the
validation loss of instruction samples packed into rows with document masks equal those of the
same samples padded one per row, and both equal a single-process reference that runs each
sample alone through the plain model, to 1e-5. tp = 2 and 4 (sequence parallel: attention
gathers the whole row, documents are never split) equal tp = 1. LoRA on packed rows on (2,2)
equals PEFT running each sample alone, to 1e-5."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybrid2d.models.llama import Llama
from tests.launch import check_ok, run_ranks
from tests.reference import reference_optimizer
from tests.test_parity import relative
from tests.workers.packing_parity import (
    DATA_SEED,
    LORA,
    MESHES,
    packing_config,
    step_samples,
    synthetic_samples,
)

pytestmark = pytest.mark.slow


def alone(ds, i) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i by itself: inputs [1, n - 1] and labels (-100 off the loss), no padding."""
    lo, hi = int(ds.offsets[i]), int(ds.offsets[i + 1])
    ids = torch.from_numpy(ds.tokens[lo:hi].astype(np.int64))
    keep = torch.from_numpy(np.asarray(ds.targets_flat[lo + 1 : hi]))
    return ids[None, :-1], ids[1:].masked_fill(~keep, -100)[None]


def summed_loss(model, ds, samples) -> tuple[torch.Tensor, int]:
    total, count = torch.zeros(()), 0
    for i in samples:
        inputs, labels = alone(ds, int(i))
        total = total + F.cross_entropy(model(inputs)[0], labels[0], reduction="sum")
        count += int((labels != -100).sum())
    return total, count


def reference(cfg, ds, val_ds) -> dict:
    """One process, each sample alone: the step's summed token loss over its loss tokens."""
    t = cfg.train
    model = Llama(cfg.model)
    model.init_weights(t.seed)
    opt, sched = reference_optimizer(model, t)
    out = {"losses": [], "norms": []}
    for step, samples in enumerate(step_samples(ds, cfg)):
        total, count = summed_loss(model, ds, samples)
        loss = total / count
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    with torch.no_grad():
        total, count = summed_loss(model, val_ds, range(len(val_ds)))
    out["val_loss"] = (total / count).item()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def assert_close(got: dict, ref: dict, what: str) -> None:
    for key in ("losses", "norms"):
        for a, b in zip(got[key], ref[key], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (what, key, got[key], ref[key])
    assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-5 * ref["val_loss"], what
    for key in ("grads", "params"):
        for name, expected in ref[key].items():
            assert relative(got[key][name], expected) <= 1e-5, (what, key, name)


def lora_reference(cfg, ds) -> dict:
    """LoRA in one process, each sample alone through PEFT over transformers' model (the
    independent reference, tests/lora_reference.py), with the trainer's initial base and
    adapters, SGD with clipping: losses, norms, the first step's adapter gradients, the final
    adapters."""
    pytest.importorskip("peft")
    from tests.lora_reference import ours, peft_adapters, peft_twin

    t = cfg.train
    twin = peft_twin(ours(cfg.model, LORA, t.seed), LORA)
    adapters = peft_adapters(twin)
    opt, sched = reference_optimizer(twin, t)
    out = {"losses": [], "norms": []}
    for step, samples in enumerate(step_samples(ds, cfg)):
        total, count = summed_loss(lambda x: twin(x).logits, ds, samples)
        loss = total / count
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in adapters.items()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(adapters.values(), t.grad_clip).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in adapters.items()}
    return out


def test_packed_equals_padded_and_each_sample_alone_on_three_meshes(tmp_path):
    cfg = packing_config()
    ds, val_ds = synthetic_samples(200, DATA_SEED), synthetic_samples(11, DATA_SEED + 1)
    steps = step_samples(ds, cfg)
    assert min(len(s) for s in steps) > 2 * cfg.train.global_batch  # rows hold several samples
    out = tmp_path / "out.pt"
    check_ok(run_ranks(4, ["tests/workers/packing_parity.py", str(out)], timeout=600))
    results = torch.load(out)
    ref = reference(cfg, ds, val_ds)
    for dp, tp in MESHES:
        for micro in (1, 2):
            packed, padded = results[(dp, tp, micro, "packed")], results[(dp, tp, micro, "padded")]
            assert packed["samples"] == [len(s) for s in steps]
            assert_close(packed, ref, f"packed dp{dp} tp{tp} micro{micro}")
            assert_close(padded, ref, f"padded dp{dp} tp{tp} micro{micro}")
            assert_close(packed, padded, f"packed vs padded dp{dp} tp{tp} micro{micro}")
    # LoRA on packed rows with document masks, (2, 2), micro batch 2: PEFT, each sample alone.
    lora = lora_reference(cfg, ds)
    assert sorted(results["lora"]["grads"]) == sorted(lora["grads"])
    for key in ("losses", "norms"):
        for a, b in zip(results["lora"][key], lora[key], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), ("lora", key, results["lora"][key], lora[key])
    for key in ("grads", "params"):  # (A's first gradients are 0: B starts at 0)
        for name, expected in lora[key].items():
            got = results["lora"][key][name]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=f"{key} {name}")
