"""The benchmark's correctness parts: every kind starts from the same weights (bit for bit) and
batches."""

import json
import subprocess
import sys
from types import SimpleNamespace

import bench  # tools/bench.py (pyproject: the tests' pythonpath holds tools/)
import pytest
import torch

from hybrid2d.config import ModelConfig
from hybrid2d.metrics import flops_per_token
from tests.launch import REPO


@pytest.mark.slow
def test_kinds_start_from_the_same_weights(tmp_path):
    out = tmp_path / "bench.json"
    small = [
        "--dim",
        "64",
        "--layers",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "128",
        "--vocab",
        "512",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "tools/bench.py",
            "--mesh",
            "2x2",
            "--repeats",
            "1",
            "--steps",
            "2",
            "--warmup",
            "0",
            *small,
            "--peak-tflops",
            "0.5",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "hybrid2d / transformers tokens/s" in proc.stdout  # the table was printed
    kinds = json.loads(out.read_text())["2x2"]["kinds"]
    # bench.py compared a SHA-256 of every parameter tensor of every run after loading (it
    # exits non-zero naming the first tensor that differs); its digest over them is the same
    # for every kind, and covers every tensor: 9 per block + embedding, final norm, head.
    assert {k: v["weight_tensors"] for k, v in kinds.items()} == {
        "hybrid2d": 2 * 9 + 3,
        "transformers": 2 * 9 + 3,
        "single": 2 * 9 + 3,
    }
    digests = {v["weights_sha256"] for v in kinds.values()}
    assert len(digests) == 1 and None not in digests, kinds
    # MFU: model FLOPs per token (checked against FlopCounterMode in test_flops) x tokens/s over
    # the peak given; on CPU every kind has the whole host.
    model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)
    for kind in kinds.values():
        expected = flops_per_token(model, 32) * kind["tokens_per_s"] / 0.5e12
        assert kind["mfu"] == pytest.approx(expected, rel=1e-9)
    assert "| MFU |" in proc.stdout


def synthetic_runs(step_s: dict[str, float]) -> dict:
    return {
        label: [{"times": [t, t], "losses": [1.0, 0.9], "peak_mem": [2**20]}]
        for label, t in step_s.items()
    }


def test_efficiency_counts_gpus_on_cuda_and_the_shared_host_on_cpu():
    model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)
    runs = synthetic_runs({"hybrid2d": 0.3, "transformers": 0.6, "single": 1.0})
    args = SimpleNamespace(global_batch=8, seq_len=16, warmup=0, world=4, peak_flops=1e12)
    args.device = "cuda"  # 4 GPUs against 1: 1.0 / (4 x 0.3)
    row = bench.summarize(runs, args, model)
    assert row["kinds"]["hybrid2d"]["efficiency"] == pytest.approx(1.0 / (4 * 0.3))
    assert row["kinds"]["transformers"]["efficiency"] == pytest.approx(1.0 / (4 * 0.6))
    assert row["speedup_vs_transformers"] == pytest.approx(2.0)
    tokens_per_s = 8 * 16 / 0.3
    fpt = flops_per_token(model, 16)
    assert row["kinds"]["hybrid2d"]["mfu"] == pytest.approx(fpt * tokens_per_s / 4e12)
    assert row["kinds"]["single"]["mfu"] == pytest.approx(fpt * 8 * 16 / 1.0 / 1e12)
    table = bench.format_table({"2x2": row}, "cuda")
    assert "| 2x2 | hybrid2d | 0.300 | 427 | 83% | 0.00696% | 1.00x |" in table
    args.device, args.peak_flops = "cpu", None  # the same cores for every kind: 1.0 / 0.3
    row = bench.summarize(runs, args, model)
    assert row["kinds"]["hybrid2d"]["efficiency"] == pytest.approx(1.0 / 0.3)
    table = bench.format_table({"2x2": row}, "cpu")
    assert "MFU" not in table and "| 2x2 | hybrid2d | 0.300 | 427 | 333% | 1.00x |" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesh", "2by2"], "--mesh '2by2' is not DPxTP"),
        (["--mesh", "3x2"], "train.global_batch=8 is not divisible by the data-parallel size 3"),
        (["--warmup", "8"], "--warmup 8 must be at least 0 and below --steps 8"),
        (["--lever", "train.micro_batch"], "'train.micro_batch' (--set / --lever) is not"),
        (["--lever", "train.micro_batch=3"], "train.micro_batch=3 does not divide"),
        (["--heads", "12", "--kv-heads", "4"], "dim=256 is not divisible by model.n_heads=12"),
        (["--peak-tflops", "-1"], "--peak-tflops -1.0 must be > 0"),
    ],
)
def test_bad_input_is_one_line_before_any_run(argv, message):
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_without_a_gpu_is_refused():
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--device", "cuda"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "error: --device cuda, but no CUDA device is visible; use --device cpu"
    )


def test_distributed_kinds_let_torchrun_bind_its_ports():
    """No port is picked before the launch (a port found free can be taken before torchrun
    binds it): --standalone makes torchrun's agent bind port 0 itself."""
    cmd = bench.torchrun_command(4, ["worker.py", "--out", "x.json"])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    assert cmd[5:] == ["4", "worker.py", "--out", "x.json"]
    assert not any("port" in a or "rdzv" in a for a in cmd)


@pytest.mark.parametrize("family", bench.FAMILIES)
def test_family_shape_is_a_model_transformers_loads_as_its_class(tmp_path, family):
    """--family: the benchmark's shape as the family builds it validates, and the HF directory
    every kind starts from loads in transformers as that family's class with our weights."""
    from transformers import AutoModelForCausalLM

    from hybrid2d.models.llama import Llama

    args = SimpleNamespace(dim=64, layers=3, heads=4, kv_heads=2, ffn=96, vocab=256, seq_len=32)
    model = bench.bench_model(args, family)
    assert model.family == family
    if family in ("mistral", "gemma3"):
        assert 0 < model.sliding_window < args.seq_len  # the masks are exercised
        assert "F" in model.layer_types or family == "mistral"
    bench.write_model_dir(model, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(hf).__name__.lower().startswith(family)
    ours = Llama(model)
    ours.init_weights(0)
    theirs = hf.state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(theirs[name], value), name


def test_families_run_llama_first_and_each_once():
    args = SimpleNamespace(family=["gemma3", "all", "llama"])
    assert bench.families(args) == ["llama", "gemma3", "mistral", "qwen2", "qwen3"]
    assert bench.families(SimpleNamespace(family=[])) == ["llama"]


def test_balance_cost_compares_on_and_off_and_reports_the_monitor_time():
    model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)
    runs = synthetic_runs({"hybrid2d": 0.505, f"hybrid2d + {bench.BALANCE_OFF}": 0.5})
    runs["hybrid2d"][0]["monitor_s"] = [(0.004, 0.001), (0.002, 0.0005)]  # (wall, CPU) per step
    args = SimpleNamespace(global_batch=8, seq_len=16, warmup=0, world=4, peak_flops=None)
    args.device = "cpu"
    row = bench.summarize(runs, args, model)
    assert row["kinds"]["hybrid2d"]["monitor_s"] == pytest.approx(0.003)  # the median
    assert "monitor_s" not in row["kinds"][f"hybrid2d + {bench.BALANCE_OFF}"]
    line = bench.balance_cost({"2x2": row}).splitlines()[1]
    assert line.startswith("  2x2: 0.5050 s/step on, 0.5000 off (+1.00%)"), line
    assert "3.00 ms/step wall (0.59%" in line and "0.75 ms CPU (0.15%)" in line


def test_lora_runs_are_compared_on_their_base():
    """--lever lora.rank=...: a LoRA run has adapters the full fine-tuning run has not; its base
    must still be the same weights (a bf16 base, the other's rounded: by name only)."""
    base = {"model.layers.0.mlp.up_proj.weight": "a", "lm_head.weight": "b"}
    lora = base | {"model.layers.0.mlp.up_proj.lora_A.weight": "c"}
    kinds = {
        "hybrid2d": ("hybrid2d", []),
        "hybrid2d + lora.rank=4": ("hybrid2d", ["--set", "lora.rank=4"]),
        "hybrid2d + bf16": ("hybrid2d", ["--set", "lora.rank=4", "--set", "lora.base_dtype=bf16"]),
    }

    def runs(lora_sums, bf16_sums):
        return {
            "hybrid2d": [{"checksums": base}],
            "hybrid2d + lora.rank=4": [{"checksums": lora_sums}],
            "hybrid2d + bf16": [{"checksums": bf16_sums}],
        }

    rounded = {n: v + "'" for n, v in lora.items()}
    bench.check_same_weights(runs(lora, rounded), "2x2", kinds)
    with pytest.raises(SystemExit, match="lm_head.weight"):
        bench.check_same_weights(runs(lora | {"lm_head.weight": "x"}, rounded), "2x2", kinds)
    with pytest.raises(SystemExit, match="has parameters"):
        bench.check_same_weights(runs(lora, {"lm_head.weight": "b"}), "2x2", kinds)
