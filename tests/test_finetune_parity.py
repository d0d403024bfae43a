"""Masked loss (instruction data) on (dp, tp) meshes with micro batches equals one process on
the same global batches: losses, grad norms and final parameters to 1e-5 relative, SGD with
clipping and AdamW; the validation loss on a held-out set too."""

import pytest
import torch

from tests.launch import check_ok, run_ranks
from tests.reference import masked_global_batches, tiny_config, train_single_process_masked
from tests.test_parity import assert_matches, relative
from tests.workers.finetune_parity import val_set

pytestmark = pytest.mark.slow

CASES = [(2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 1, 2), (1, 4, 1), (1, 4, 2)]


@pytest.fixture(scope="module")
def references():
    out = {}
    for optimizer, clip in (("sgd", 0.5), ("adamw", 1.0)):
        cfg = tiny_config(optimizer, clip)
        out[optimizer] = train_single_process_masked(
            cfg, masked_global_batches(cfg), val=val_set(cfg)
        )
    return out


def test_batches_have_uneven_loss_tokens():
    cfg = tiny_config()
    counts = [int((lab != -100).sum(1).min()) for _, lab in masked_global_batches(cfg)]
    per_sample = torch.cat([(lab != -100).sum(1) for _, lab in masked_global_batches(cfg)])
    assert per_sample.min() >= 1 and per_sample.max() >= 4 * per_sample.min(), per_sample
    assert min(counts) >= 1


@pytest.mark.parametrize("dp,tp,micro", CASES, ids=[f"dp{d}xtp{t}-micro{m}" for d, t, m in CASES])
def test_masked_loss_matches_single_process(tmp_path, references, dp, tp, micro):
    out = tmp_path / "out.pt"
    args = ["tests/workers/finetune_parity.py", str(out), str(dp), str(tp), str(micro)]
    check_ok(run_ranks(dp * tp, args, timeout=600))
    got = torch.load(out)
    for optimizer in ("sgd", "adamw"):
        assert_matches(got[optimizer], references[optimizer])
        ref_val = references[optimizer]["val_loss"]
        assert abs(got[optimizer]["val_loss"] - ref_val) <= 1e-5 * ref_val, (
            got[optimizer]["val_loss"],
            ref_val,
        )
    for name, p in references["sgd"]["params"].items():
        assert relative(got["sgd"]["params"][name], p.detach()) <= 1e-5, name
