"""The planner's LoRA step (lora.rank > 0): the FLOPs it prices against torch's FlopCounterMode
on a real LoRA step, and the compute and optimizer terms that follow from a frozen base."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hybrid2d import recipes
from hybrid2d.config import ModelConfig
from hybrid2d.models.attention import dense_mask
from hybrid2d.models.llama import Llama
from hybrid2d.parallel.activation_checkpoint import apply_ac
from hybrid2d.parallel.lora import apply_lora
from hybrid2d.planner.model import flops
from tests.family_shapes import family_model
from tests.launch import check_ok, run_ranks
from tests.lora_reference import lora_job, lora_settings, odd_model, tp4_model
from tests.test_planner import load_tool


def counted_step(cfg: ModelConfig, lcfg, ac: str, seq: int, forward_only: bool = False):
    """torch's FLOP counts of one step (or forward) of our model with adapters, batch 2."""
    model = Llama(cfg)
    model.init_weights(0)
    apply_lora(model, lcfg)
    apply_ac(model, ac)
    x = torch.randint(0, cfg.vocab_size, (2, seq + 1))
    # The math backend spells attention as bmm, which the counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(x[:, :-1])
        if not forward_only:
            F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    return {
        module: {str(op): n for op, n in ops.items()}
        for module, ops in counter.get_flop_counts().items()
    }


@pytest.mark.parametrize(
    "targets, ac",
    [
        ("all-linear", "none"),
        ("q_proj,v_proj", "full"),
        ("k_proj", "none"),
        ("down_proj", "full"),
    ],
)
def test_lora_step_flops_equal_counted_matmuls(targets, ac):
    """A frozen base: no weight gradients, no input gradients before the first adapter of the
    first block, attention's backward only for q/k/v that need it, the adapters' own matmuls,
    and full checkpointing's recompute, each as torch counts them on a step of the odd model."""
    cfg, lcfg, seq, tokens = odd_model(), lora_settings(targets=targets), 11, 22
    counts = counted_step(cfg, lcfg, ac, seq)["Global"]
    assert set(counts) == {"aten.mm", "aten.bmm"}
    f = flops(cfg, seq, ac, 1, lcfg)
    assert (f["matmul"] + f["recompute_matmul"]) * tokens == pytest.approx(
        counts["aten.mm"], rel=1e-12
    )
    # The math path computes the whole score square; causal attention uses s (s + 1) / 2 pairs.
    attention = counts["aten.bmm"] * (seq + 1) / (2 * seq)
    assert (f["attention"] + f["recompute_attention"]) * tokens == pytest.approx(attention)
    if ac == "none":
        forward = counted_step(cfg, lcfg, ac, seq, forward_only=True)["Global"]
        assert f["forward_matmul"] * tokens == pytest.approx(forward["aten.mm"], rel=1e-12)
        bmm = forward["aten.bmm"] * (seq + 1) / (2 * seq)
        assert f["forward_attention"] * tokens == pytest.approx(bmm)
    assert (
        f["model"] == flops(cfg, seq, ac, 1)["model"]
    )  # MFU's numerator is the model's, as the trainer's


@pytest.mark.parametrize(
    "family, targets",
    [("qwen2", "v_proj"), ("gemma3", "k_proj")],
)
def test_lora_step_flops_of_each_family_per_layer(family, targets):
    """Biases (addmm), q/k norms, GELU, sandwich norms and windows shorter than the sequence:
    each layer's attention as its own mask lets pairs through (the first layer's backward
    differs from the others')."""
    cfg, lcfg, seq, tokens = family_model(family), lora_settings(rank=3, targets=targets), 13, 26
    counts = counted_step(cfg, lcfg, "none", seq)
    f = flops(cfg, seq, "none", 1, lcfg)
    total = counts["Global"]
    assert f["matmul"] * tokens == pytest.approx(
        total["aten.mm"] + total.get("aten.addmm", 0), rel=1e-12
    )
    cpu = torch.device("cpu")
    attention = 0.0
    for i in range(cfg.n_layers):
        pairs = int(dense_mask(None, cfg.layer_window(i), seq, cpu).sum())
        attention += counts[f"Llama.model.layers.{i}"]["aten.bmm"] * pairs / seq**2
    assert f["attention"] * tokens == pytest.approx(attention)


def test_plan_tool_prices_the_lora_step_below_full_fine_tuning(tmp_path):
    """tools/plan.py on one mesh and profile: the LoRA step's matmul time falls with its FLOPs
    (about 2/3 of full fine-tuning's without checkpointing), its optimizer steps the adapters
    only, and FSDP reduce-scatters only their gradients."""
    plan_tool = load_tool("plan")
    fixed = ["parallel.dp_replicate=1", "parallel.dp_shard=8", "parallel.tp=1"]
    fixed += ["parallel.activation_checkpoint=none", "train.micro_batch=1"]
    lora = ["lora.rank=16", "lora.alpha=32", "lora.base_dtype=bf16"]
    rows = {}
    for name, settings in (("full", fixed), ("lora", fixed + lora)):
        out = tmp_path / f"{name}.json"
        argv = ["--recipe", "llama3.1-8b", "--gpus-per-node", "8", "--gpu", "h100"]
        argv += [a for s in settings for a in ("--set", s)] + ["--json", str(out)]
        assert plan_tool.main(argv) == 0
        (rows[name],) = json.loads(out.read_text())
    cfg = recipes.get("llama3.1-8b")
    lcfg = dataclasses.replace(cfg.lora, rank=16)
    full_mm = flops(cfg.model, cfg.train.seq_len, "none")["matmul"]
    ratio = flops(cfg.model, cfg.train.seq_len, "none", 1, lcfg)["matmul"] / full_mm
    assert 0.6 < ratio < 0.7
    full, got = rows["full"], rows["lora"]
    # bf16 base and the same hardware: the matmul rate is the same, the time is the FLOPs'.
    assert got["details"]["matmul_s"] == pytest.approx(full["details"]["matmul_s"] * ratio)
    assert got["details"]["params_per_rank"] < full["details"]["params_per_rank"] / 50
    assert got["optimizer_s"] < full["optimizer_s"] / 50
    assert (
        got["details"]["fsdp_reduce_scatter_bytes"]
        < full["details"]["fsdp_reduce_scatter_bytes"] / 50
    )
    assert got["compute_s"] < full["compute_s"] * 0.9
    assert got["step_s"] < full["step_s"] * 0.9


@pytest.mark.slow
def test_lora_step_flops_per_tp_rank_equal_counted_matmuls(tmp_path):
    """On tp = 2, each rank computes its shard of the base and of the sharded adapter side, the
    replicated side (column layers' A, row layers' B) whole, and past the kv heads (one kv
    head, two ranks) the k/v projections and their B rows of its head: rank 0's matmuls of one
    trainer step against the planner's per-rank count (matmul + replicated, x tokens / tp)."""
    out = tmp_path / "flops.json"
    specs = ["all-linear:1", "q_proj,o_proj:4", "down_proj,k_proj:1"]
    check_ok(run_ranks(2, ["tests/workers/lora_flops.py", str(out), *specs]))
    counted = json.loads(out.read_text())
    for spec in specs:
        targets, kv = spec.rsplit(":", 1)
        cfg = lora_job(
            dataclasses.replace(tp4_model(), n_kv_heads=int(kv)), lora_settings(targets=targets)
        )
        f = flops(cfg.model, cfg.train.seq_len, "none", 2, cfg.lora)
        rank_tokens = cfg.train.global_batch * cfg.train.seq_len / 2
        want = (f["matmul"] + f["replicated_matmul"]) * rank_tokens
        assert counted[spec] == pytest.approx(want, rel=1e-12), spec
