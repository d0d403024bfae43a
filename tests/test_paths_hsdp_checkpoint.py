"""An HSDP checkpoint (dp_replicate=2 x dp_shard=1 x tp=2) resumed on (1,2,2) and on (4,1,1):
DCP reshards model and AdamW state from replicated tp shards to FSDP shards, and the resumed
steps equal the straight HSDP run's (to 1e-5: the meshes sum in other orders)."""

import pytest

from hybrid2d.checkpoint import layout
from tests.test_checkpoint_runs import args_for, assert_close, summary, train

pytestmark = pytest.mark.slow

STEPS = 10


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hsdp-cache"))
    run = tmp_path_factory.mktemp("hsdp") / "run"
    args = args_for(cache, run, dp=1, tp=2, every=5, parallel__dp_replicate=2, train__steps=STEPS)
    train(4, args)
    s = summary(run)
    assert s["mesh"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 2}
    assert layout.complete_steps(layout.checkpoints_dir(run)) == [5, 10]
    return cache, run, s


@pytest.mark.parametrize("dp,tp", [(2, 2), (4, 1)], ids=["to-1x2x2", "to-4x1x1"])
def test_hsdp_checkpoint_resumes_on_another_mesh(hsdp_run, tmp_path, dp, tp):
    cache, run, straight = hsdp_run
    ckpt = layout.final_dir(run, 5)
    resumed = tmp_path / "run"
    train(4, args_for(cache, resumed, dp=dp, tp=tp, resume=str(ckpt), train__steps=STEPS))
    r = summary(resumed)
    assert r["mesh"] == {"dp_replicate": 1, "dp_shard": dp, "tp": tp}
    assert r["resumed_from"] == str(ckpt) and r["steps"] == STEPS
    assert_close(r["losses"], straight["losses"][5:])
