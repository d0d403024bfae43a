"""2-D (dp x tp) training equals single-process PyTorch step for step (fp32, CPU, gloo)."""

import pytest
import torch

from tests.launch import check_ok, run_ranks
from tests.reference import tiny_config, train_single_process

pytestmark = pytest.mark.slow

MESHES = [(2, 2), (1, 4), (4, 1), (1, 2)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def run_parallel(tmp_path, dp, tp, optimizer, clip, dp_replicate=1, settings=()):
    out = tmp_path / f"{dp}x{tp}-{optimizer}.pt"
    args = ["tests/workers/parity.py", str(out), str(dp), str(tp), optimizer, str(clip)]
    results = run_ranks(dp * tp, args + [str(dp_replicate), *settings])
    check_ok(results)
    return {**torch.load(out), "stderr": [r.stderr for r in results]}


def assert_matches(got, ref, rtol=1e-5):
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step + 1}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step + 1}: grad norm {a} vs reference {b}"
    # Whole-model relative error of the final parameters.
    names = sorted(ref["params"])
    mine = torch.cat([got["params"][n].flatten() for n in names])
    theirs = torch.cat([ref["params"][n].detach().flatten() for n in names])
    assert relative(mine, theirs) <= rtol, f"parameters differ by {relative(mine, theirs):.2e}"


@pytest.mark.parametrize("dp,tp", MESHES, ids=[f"dp{d}xtp{t}" for d, t in MESHES])
def test_sgd_with_clipping_matches_single_process(tmp_path, dp, tp):
    # SGD: a wrongly scaled gradient shows directly in the parameters. grad_clip 0.5 is below
    # every step's norm, so the global norm and the clipping are exercised too.
    ref = train_single_process(tiny_config("sgd", 0.5))
    assert min(ref["norms"]) > 0.5
    got = run_parallel(tmp_path, dp, tp, "sgd", 0.5)
    assert_matches(got, ref)
    for name, p in ref["params"].items():  # SGD is well conditioned: check every tensor too
        assert relative(got["params"][name], p.detach()) <= 1e-5, name


@pytest.mark.parametrize("dp,tp", MESHES, ids=[f"dp{d}xtp{t}" for d, t in MESHES])
def test_adamw_matches_single_process(tmp_path, dp, tp):
    ref = train_single_process(tiny_config("adamw", 1.0))
    got = run_parallel(tmp_path, dp, tp, "adamw", 1.0)
    assert_matches(got, ref)


@pytest.mark.parametrize("defer", ["false", "true"], ids=["sync-each-micro", "deferred-sync"])
def test_gradient_accumulation_matches_single_process(tmp_path, defer):
    """4 samples per dp rank as 4 micro batches of 1: same steps as the whole batch at once."""
    ref = train_single_process(tiny_config("sgd", 0.5))
    settings = ["--train.micro_batch", "1", "--parallel.defer_grad_sync", defer]
    assert_matches(run_parallel(tmp_path, 2, 2, "sgd", 0.5, settings=settings), ref)


@pytest.mark.parametrize("shm", ["on", "off"], ids=["shared-memory", "gloo"])
def test_collectives_through_shared_memory_or_gloo_match_single_process(tmp_path, shm):
    """parallel.shm_collectives=on must use shared memory (an error otherwise) for tp and FSDP;
    off keeps every collective on gloo (here with explicit FSDP prefetching, which only
    reorders gloo's asynchronous all-gathers). Both train like one process."""
    ref = train_single_process(tiny_config("adamw", 1.0))
    settings = ["--parallel.shm_collectives", shm]
    if shm == "off":
        settings += ["--parallel.fsdp_prefetch", "2"]
    got = run_parallel(tmp_path, 2, 2, "adamw", 1.0, settings=settings)
    assert_matches(got, ref)
    if shm == "on":
        # Per step of the 2-block model: tp 8 per block + 2 embedding + 2 output (sequence),
        # 3 loss, 5 norm gradients; FSDP 3 units: 3 + 1 (re-gathered block) all-gathers and 3
        # reduce-scatters.
        assert got["shm"] == {"tp": 28, "dp": 7}, got["shm"]
    else:
        assert got["shm"] == {}


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_matches_single_process(tmp_path, ac):
    """full recomputes blocks, communication included: 3 more tp collectives per block (the
    recomputation stops before the block's last reduce-scatter, whose output backward does not
    need). selective keeps matmul, attention and collective outputs, so backward communicates
    no more than without checkpointing."""
    ref = train_single_process(tiny_config("sgd", 0.5))
    settings = ["--parallel.activation_checkpoint", ac, "--parallel.shm_collectives", "on"]
    got = run_parallel(tmp_path, 2, 2, "sgd", 0.5, settings=settings)
    assert_matches(got, ref)
    per_step = {"full": 28 + 2 * 3, "selective": 28}[ac]
    assert got["shm"]["tp"] == per_step
