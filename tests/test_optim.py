import json
import math

import pytest
import torch

from hybrid2d.config import TrainConfig
from hybrid2d.optim import clip_grad_norm, lr_multiplier
from tests.launch import check_ok, run_ranks


def test_lr_schedule_warmup_then_cosine():
    t = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, t) == 0.1
    assert lr_multiplier(9, t) == 1.0
    assert lr_multiplier(10, t) == 1.0
    mid = 10 + 45
    assert math.isclose(lr_multiplier(mid, t), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_multiplier(100, t), 0.1)


def test_clip_grad_norm_matches_torch_single_process():
    gen = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for pa, pb in zip(a, b, strict=True):
        g = torch.randn(pa.shape, generator=gen)
        pa.grad, pb.grad = g.clone(), g.clone()
    expected = torch.nn.utils.clip_grad_norm_(b, 0.5)
    got = clip_grad_norm(a, 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_mixed_dtypes_matches_torch():
    gen = torch.Generator().manual_seed(1)
    shapes_dtypes = [((7, 3), torch.float32), ((11,), torch.bfloat16), ((4, 4), torch.float32)]
    a = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in shapes_dtypes]
    b = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in shapes_dtypes]
    for pa, pb in zip(a, b, strict=True):
        g = torch.randn(pa.shape, generator=gen).to(pa.dtype)
        pa.grad, pb.grad = g.clone(), g.clone()
    expected = torch.nn.utils.clip_grad_norm_(b, 0.3)
    got = clip_grad_norm(a, 0.3)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=0)
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa.grad, pb.grad)


def test_clip_grad_norm_zero_only_measures():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm([p], 0.0).item() == 5.0
    assert p.grad.tolist() == [3.0, 4.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("dp, tp, dp_replicate", [(2, 2, 1), (2, 2, 2)])
def test_clip_grad_norm_on_tp_x_fsdp_dtensors(tmp_path, dp, tp, dp_replicate):
    """TP x FSDP2 DTensor gradients (Shard, Replicate and _StridedShard placements): the norm
    equals the full gradients' (float64) and torch.nn.utils.get_total_norm's, in one all-reduce,
    and clipping scales every shard by the same coefficient."""
    out = tmp_path / "norm.json"
    results = run_ranks(
        dp * tp,
        ["tests/workers/grad_norm.py", str(out), str(dp), str(tp), "3", str(dp_replicate)],
    )
    check_ok(results)
    r = json.loads(out.read_text())
    if dp_replicate == 1:
        assert any("_StridedShard" in p for p in r["placements"]), r["placements"]
    assert r["hybrid2d"]["rel_err"] < 1e-6 and r["torch"]["rel_err"] < 1e-5, r
    assert r["hybrid2d"]["collectives"] == 1, r["hybrid2d"]
    assert r["clip_max_err"] < 1e-6
