"""LoRA runs end to end: checkpoints hold the adapters only, resume exactly on another mesh,
refuse another base, and export to PEFT's format, which PEFT loads with our logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")

import peft  # noqa: E402
import transformers  # noqa: E402

from hybrid2d.checkpoint import layout, standalone  # noqa: E402
from hybrid2d.checkpoint.adapters import check_same_base  # noqa: E402
from hybrid2d.checkpoint.hf import load_pretrained  # noqa: E402
from hybrid2d.checkpoint.reader import (  # noqa: E402
    iter_model_tensors,
    model_entries,
    read_config,
    read_metadata,
)
from hybrid2d.errors import ConfigError  # noqa: E402
from hybrid2d.models.llama import Llama  # noqa: E402
from hybrid2d.parallel.lora import apply_lora, is_adapter  # noqa: E402
from tests.launch import REPO, launcher_env, torchrun  # noqa: E402
from tests.workers.hf_chat import make_chat_model  # noqa: E402

pytestmark = pytest.mark.slow


def train(tmp_path, run_dir, *more, world=1):
    cmd = [sys.executable, "recipes/llama.py", "--data.path", str(tmp_path / "text.txt"),
           "--checkpoint.init_from", f"hf:{tmp_path / 'hf'}", "--train.seq_len", "32",
           "--train.global_batch", "4", "--train.steps", "4", "--train.warmup_steps", "0",
           "--train.lr", "0.01", "--lora.rank", "4", "--lora.alpha", "8",
           "--lora.targets", "q_proj,v_proj,o_proj,down_proj",
           "--data.cache_dir", str(tmp_path / "cache"), "--metrics.run_dir", str(run_dir),
           "--metrics.progress_bar", "false", "--metrics.tensorboard", "false",
           *more]  # fmt: skip
    if world > 1:
        cmd = torchrun(world, *cmd[1:])
    return subprocess.run(
        cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600
    )


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_lora_checkpoint_resume_on_another_mesh_and_peft_export(tmp_path):
    make_chat_model(str(tmp_path / "hf"))
    (tmp_path / "text.txt").write_text("def answer():\n    return 42  # the answer\n" * 60)

    straight = train(tmp_path, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = train(tmp_path, tmp_path / "split", "--parallel.tp", "2",
                  "--checkpoint.stop_after", "2", world=4)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(tmp_path, tmp_path / "split", "--checkpoint.resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # 2x2 for steps 1-2, one process for 3-4: the uninterrupted run's losses.
    losses = summary(tmp_path / "split")["losses"]
    assert summary(tmp_path / "split")["first_step"] == 3
    torch.testing.assert_close(
        losses, summary(tmp_path / "straight")["losses"][2:], rtol=1e-5, atol=0
    )

    # The checkpoint's model entry is the adapters only: the base is not saved again.
    step = layout.latest_in_run(tmp_path / "split")
    names = set(model_entries(read_metadata(step), step))
    assert names and all(is_adapter(n) for n in names), sorted(names)[:3]
    assert len(names) == 2 * 4 * 2  # A and B of 4 targets in 2 blocks

    # Another base: one line naming both, before anything is built.
    cfg = read_config(step)
    cfg.checkpoint.init_from = f"hf:{tmp_path}"
    with pytest.raises(ConfigError, match=r"^checkpoint .* holds adapters trained on the base hf:"):
        check_same_base(step, cfg)
    other = train(tmp_path, tmp_path / "split", "--checkpoint.resume", "auto",
                  "--train.steps", "6", "--lora.base_dtype", "bf16")  # fmt: skip
    assert other.returncode == 2, other.stderr[-2000:]
    errors = [ln for ln in other.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--lora.base_dtype fp32" in errors[0], other.stderr[-2000:]

    # The whole-model tools say what a LoRA checkpoint is instead of naming a missing tensor.
    with pytest.raises(ConfigError, match=r"is a LoRA run's: .*tools/export_lora.py .*over hf:"):
        standalone.model_config(standalone.locate(str(step)))

    # Export to PEFT's format; PEFT over transformers gives our model's logits.
    out = tmp_path / "adapter"
    proc = subprocess.run(
        [sys.executable, "tools/export_lora.py", str(tmp_path / "split"), str(out),
         "--merged", str(tmp_path / "merged")],
        cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "exported 16 adapter tensors (rank 4, alpha 8)" in proc.stdout
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()

    cfg = read_config(step)
    ours = Llama(cfg.model)
    apply_lora(ours, cfg.lora)
    load_pretrained(ours, f"hf:{tmp_path / 'hf'}")
    adapters = dict(iter_model_tensors(step))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter(name):
                p.copy_(adapters[name])
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_B." in n)  # trained
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    assert "merged 8 adapted weights into" in proc.stdout
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=tokens).logits, expected, rtol=1e-5, atol=1e-5)
