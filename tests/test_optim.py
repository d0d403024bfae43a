import math

import torch

from hybrid2d.config import TrainConfig
from hybrid2d.optim import clip_grad_norm, lr_multiplier


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
