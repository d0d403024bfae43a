"""2-D (dp x tp) training equals single-process PyTorch step for step (fp32, CPU, gloo)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hybrid2d.checkpoint import layout as ckpt_layout
from hybrid2d.checkpoint.hf_convert import convert_dcp_to_hf
from hybrid2d.checkpoint.reader import model_entries, read_metadata
from hybrid2d.config import ModelConfig
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


def assert_matches(got, ref, rtol=1e-5, where=""):
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{where}step {step + 1}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{where}step {step + 1}: norm {a} vs reference {b}"
    # Whole-model relative error of the final parameters.
    names = sorted(ref["params"])
    mine = torch.cat([got["params"][n].flatten() for n in names])
    theirs = torch.cat([ref["params"][n].detach().flatten() for n in names])
    assert relative(mine, theirs) <= rtol, (
        f"{where}parameters differ by {relative(mine, theirs):.2e}"
    )


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


# ---- every family, and tp past the kv heads ---------------------------------------------------

# Tiny models of each family's switches, with odd shapes; every one splits over tp = 4, and
# tp = 4 (2 for gemma3) exceeds its kv heads, so those ranks share kv heads.
FAMILIES = {
    "qwen2": dict(  # q/k/v biases
        family="qwen2", dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=100,
        vocab_size=260, qkv_bias=True, rope_theta=1e6,
    ),
    "qwen3": dict(  # per-head q/k norms, head_dim 16 != dim / heads = 10
        family="qwen3", dim=40, n_layers=2, n_heads=4, n_kv_heads=2, attn_head_dim=16,
        ffn_dim=72, vocab_size=256, qk_norm=True, rope_theta=1e6,
    ),
    "gemma3": dict(  # one kv head, sandwich (1 + w) norms, a window shorter than the sequence
        family="gemma3", dim=48, n_layers=2, n_heads=4, n_kv_heads=1, attn_head_dim=16,
        ffn_dim=64, vocab_size=256, qk_norm=True, norm_plus_one=True, sandwich_norms=True,
        mlp_activation="gelu_tanh", scale_embeddings=True, attn_scale_base=20.0,
        sliding_window=5, layer_types="SF", rope_theta=1e6, rope_local_theta=1e4,
        tie_embeddings=True,
    ),
}  # fmt: skip
FAMILY_MESHES = [(2, 2), (1, 4), (4, 1)]


def family_reference(name: str) -> dict:
    cfg = tiny_config("sgd", 0.5)
    cfg.model = ModelConfig(**FAMILIES[name])
    return train_single_process(cfg)


# Runs beside the plain ones: compiled blocks under selective checkpointing on (2, 2) (gemma3's
# tp 2 shares its one kv head; the suite's only compiled selective run: FSDP around compiled
# tensor-parallel blocks, see test_paths_parity for the others) and full checkpointing on (1, 4).
VARIANTS = {
    (2, 2): {"gemma3-compiled": ("gemma3", ["--parallel.compile", "true",
                                             "--parallel.activation_checkpoint", "selective"])},
    (1, 4): {"qwen3-full-ac": ("qwen3", ["--parallel.activation_checkpoint", "full"])},
}  # fmt: skip


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """One launch per mesh trains every family; the (2, 2) launch also saves each at step 5,
    which the (1, 4) launch resumes, and qwen2's step 5 exported to HF is loaded (`hf:`) on
    (1, 4), where tp exceeds its kv heads (3 launches in all)."""
    tmp = tmp_path_factory.mktemp("families")
    exported = tmp / "qwen2-hf"
    got = {}
    for dp, tp in FAMILY_MESHES:
        runs = []
        for name, model in FAMILIES.items():
            run = {"name": name, "model": model}
            if (dp, tp) == (2, 2):
                run["save"] = str(tmp / f"run-{name}")
            runs.append(run)
            if (dp, tp) == (1, 4):
                runs.append({**run, "name": f"{name}-resumed", "resume": str(tmp / f"run-{name}")})
        for variant, (name, settings) in VARIANTS.get((dp, tp), {}).items():
            runs.append({"name": variant, "model": FAMILIES[name], "settings": settings})
        if (dp, tp) == (1, 4):
            hf = {"init_from": f"hf:{exported}", "steps": 0}
            runs.append({"name": "qwen2-hf", "model": FAMILIES["qwen2"], **hf})
        out = tmp / f"{dp}x{tp}.pt"
        args = ["tests/workers/parity.py", "families", str(out), str(dp), str(tp), json.dumps(runs)]
        results = run_ranks(dp * tp, args, timeout=600)
        check_ok(results)
        got[(dp, tp)] = torch.load(out)
        got[("stderr", dp, tp)] = [r.stderr for r in results]
        if (dp, tp) == (2, 2):
            step = ckpt_layout.final_dir(tmp / "run-qwen2", 5)
            convert_dcp_to_hf(str(step), str(exported), progress=False)
            got["exported"] = load_file(exported / "model.safetensors")
            gemma = ckpt_layout.final_dir(tmp / "run-gemma3", 5)
            got["gemma3-saved"] = {
                n: tuple(t.size) for n, t in model_entries(read_metadata(gemma), str(gemma)).items()
            }
    return got


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_trains_like_one_process_on_every_mesh(family_runs, name):
    """10 SGD steps with clipping on (2, 2), (1, 4) and (4, 1) equal one process to 1e-5."""
    ref = family_reference(name)
    runs = [(mesh, family_runs[mesh][name]) for mesh in FAMILY_MESHES]
    runs += [
        (m, family_runs[m][v])
        for m, vs in VARIANTS.items()
        for v, (n, _) in vs.items()
        if n == name
    ]
    for mesh, got in runs:
        assert_matches(got, ref, where=f"mesh {mesh}: ")
        for pname, p in ref["params"].items():
            assert relative(got["params"][pname], p.detach()) <= 1e-5, (mesh, pname)


def test_compiled_selective_blocks_print_no_in_place_advice(family_runs):
    """torch.compile printed its in-place advice for a checkpoint with a context_fn on every
    rank of a compiled selective run (parallel/activation_checkpoint.py drops it); the (2, 2)
    launch holds one such run, which trains like one process (the test above)."""
    assert "gemma3-compiled" in family_runs[(2, 2)]
    stderr = family_runs[("stderr", 2, 2)]
    assert len(stderr) == 4 and not any("context_fn is passed" in err for err in stderr)


def test_kv_heads_shared_over_tp_are_stored_once_and_load_from_hf(family_runs):
    """gemma3 saved on (2, 2), where 2 tp ranks share its kv head: the checkpoint holds it once.
    qwen2 saved on (2, 2) and exported: HF's k/v shapes; loaded with hf: on (1, 4) (2 ranks per
    kv head), every parameter is the file's tensor."""
    gemma = ModelConfig(**FAMILIES["gemma3"])
    saved = family_runs["gemma3-saved"]
    for proj in ("k_proj", "v_proj"):
        assert saved[f"model.layers.1.self_attn.{proj}.weight"] == (gemma.head_dim, gemma.dim)
    m = ModelConfig(**FAMILIES["qwen2"])
    tensors = family_runs["exported"]
    kv_rows = m.n_kv_heads * m.head_dim
    for layer in range(m.n_layers):
        for proj in ("k_proj", "v_proj"):
            assert tensors[f"model.layers.{layer}.self_attn.{proj}.weight"].shape == (
                kv_rows,
                m.dim,
            )
            assert tensors[f"model.layers.{layer}.self_attn.{proj}.bias"].shape == (kv_rows,)
    loaded = family_runs[(1, 4)]["qwen2-hf"]["params"]
    assert sorted(loaded) == sorted(tensors)
    for name, value in loaded.items():
        assert torch.equal(value, tensors[name]), name


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_resumed_on_another_mesh_trains_on_exactly(family_runs, name):
    """Saved after step 5 on (2, 2), resumed on (1, 4) where tp exceeds the kv heads: steps 6 to
    10 equal the reference's."""
    ref = family_reference(name)
    tail = {"losses": ref["losses"][5:], "norms": ref["norms"][5:], "params": ref["params"]}
    assert_matches(family_runs[(1, 4)][f"{name}-resumed"], tail)
