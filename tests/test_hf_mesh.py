"""init_from dcp: and hf: on a 2x2 (dp x tp) mesh, 4 CPU ranks, against HF transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from hybrid2d.checkpoint.hf_convert import convert_hf_to_dcp  # noqa: E402
from tests.launch import check_ok, run_ranks  # noqa: E402
from tests.workers.hf_models import CASES, make_hf_model  # noqa: E402

pytestmark = pytest.mark.slow

# seq 16: divisible by tp (sequence parallelism).
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """One 4-rank launch loads every case both ways; returns (results, references)."""
    root = tmp_path_factory.mktemp("hfmesh")
    torch.save(TOKENS, root / "tokens.pt")
    args, refs = [], {}
    for name in CASES:
        hf_dir, dcp_dir = root / name, root / f"{name}.dcp"
        model = make_hf_model(name, str(hf_dir))
        convert_hf_to_dcp(str(hf_dir), str(dcp_dir), progress=False)
        with torch.no_grad():
            logits = model(TOKENS).logits
        tensors = {}
        for f in hf_dir.glob("*.safetensors"):
            tensors.update(load_file(f))
        refs[name] = (logits, tensors)
        args += [name, str(hf_dir), str(dcp_dir)]
    out = root / "out.pt"
    check_ok(run_ranks(4, ["tests/workers/hf_load.py", str(out), str(root / "tokens.pt"),
                           "2", "2", *args], timeout=600))  # fmt: skip
    return torch.load(out), refs


@pytest.mark.parametrize("kind", ["dcp", "hf"])
@pytest.mark.parametrize("case", list(CASES))
def test_2x2_logits_equal_transformers(mesh_run, case, kind):
    results, refs = mesh_run
    got = results[(case, kind)]
    torch.testing.assert_close(got["logits"], refs[case][0], rtol=1e-5, atol=1e-5)
    # Every sharded parameter holds exactly the file's tensor (gathered with full_tensor).
    tensors = refs[case][1]
    for name, value in got["params"].items():
        assert torch.equal(value, tensors[name]), name
    assert got["tied"] == (case == "tied")


@pytest.mark.parametrize("case", list(CASES))
def test_2x2_hf_each_rank_reads_a_quarter(mesh_run, case):
    got = mesh_run[0][(case, "hf")]
    total = got["checkpoint_bytes"]
    for rank, n in enumerate(got["bytes_read"]):
        # A quarter of every matrix; the tiny norm weights are split by dp only (half each).
        assert 0.24 * total <= n <= 0.26 * total, f"rank {rank} read {n} of {total} bytes"
    assert sum(got["bytes_read"]) >= total
