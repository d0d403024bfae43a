import json
import math

import pytest
import torch

from hybrid2d.config import TrainConfig
from hybrid2d.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    follow_settings,
    lr_multiplier,
)
from tests.launch import check_ok, run_ranks


def test_lr_schedule_warmup_then_cosine():
    t = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, t) == 0.1
    assert lr_multiplier(9, t) == 1.0
    assert lr_multiplier(10, t) == 1.0
    mid = 10 + 45
    assert math.isclose(lr_multiplier(mid, t), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_multiplier(100, t), 0.1)


def _stepped(t: TrainConfig, steps: int, state=None):
    """A two-group model's AdamW and schedule after `steps` updates (or loaded from `state`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, t)
    sched = build_scheduler(opt, t)
    if state is not None:
        opt.load_state_dict(state[0])
        sched.load_state_dict(state[1])
        follow_settings(opt, sched, t)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_resume_follows_this_launchs_lr_and_schedule_not_the_checkpoints(optimizer):
    """Saved after 10 of 20 steps at lr 3e-3; resumed with lr 1e-3, 14 steps, other betas and
    weight decay: every update from the first on uses the new settings, as a run started with
    them would at that step. Before: the checkpoint's base lr (3x) for every step, and the old
    schedule's lr for the first."""
    old = TrainConfig(lr=3e-3, steps=20, warmup_steps=4, optimizer=optimizer)
    new = TrainConfig(
        lr=1e-3, steps=14, warmup_steps=4, optimizer=optimizer, beta2=0.99, weight_decay=0.5
    )
    opt, sched = _stepped(old, 10)
    resumed, rsched = _stepped(new, 0, (opt.state_dict(), sched.state_dict()))
    fresh, fsched = _stepped(new, 10)  # the new settings' schedule at the same step
    for step in (10, 11, 12):
        want = 1e-3 * lr_multiplier(step, new)
        assert want != pytest.approx(3e-3 * lr_multiplier(step, new))
        for group, ref in zip(resumed.param_groups, fresh.param_groups, strict=True):
            assert group["lr"] == pytest.approx(want) == ref["lr"]
            for key in ("betas", "weight_decay", "initial_lr"):
                assert group.get(key) == ref.get(key), key
        resumed.step()
        rsched.step()
        fresh.step()
        fsched.step()
    if optimizer == "adamw":
        assert [g["weight_decay"] for g in resumed.param_groups] == [0.5, 0.0]
        assert resumed.param_groups[0]["betas"] == (0.9, 0.99)


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
