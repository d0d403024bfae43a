"""The one resolution step: settings + world + launcher sizes + init_from + plan auto give a
frozen RunLayout, and the settings object comes out of it exactly as it went in."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest

from hybrid2d import recipes
from hybrid2d.cli import apply_overrides
from hybrid2d.errors import ConfigError
from hybrid2d.launcher import launcher_sizes, launcher_sizes_note, layout_for_world
from hybrid2d.layout import RunLayout, mesh_sizes
from hybrid2d.planner.launch import profile_for
from hybrid2d.planner.search import best_plan
from hybrid2d.resolve import resolve_layout

transformers = pytest.importorskip("transformers")
from tests.workers.hf_chat import make_chat_model  # noqa: E402


def resolved(cfg, set_on_cli, world, hw_name="cpu"):
    """resolve_layout, and a check that it left cfg as it was (every field, deep)."""
    before = copy.deepcopy(cfg.to_dict())
    layout, line = resolve_layout(cfg, set_on_cli, world, world, profile_for(hw_name, "cpu"))
    assert cfg.to_dict() == before
    return layout, line


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "hf"
    make_chat_model(str(path))  # dim 64, 4 heads, 2 kv heads, ffn 96, vocab 384, tied
    return path


def test_launcher_sizes_fill_what_the_command_line_leaves(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    cfg = recipes.get("llama-debug")
    layout, line = resolved(cfg, set(), 4)
    assert (layout.mesh_shape, layout.dp, layout.world, line) == ((1, 2, 2), 2, 4, None)
    assert (layout.local_batch, layout.micro_batch, layout.n_micro) == (4, 4, 1)
    # the command line wins over the launcher
    names = apply_overrides(cfg, ["--parallel.tp", "1", "--train.micro_batch", "2"])
    layout, _ = resolved(cfg, names, 2)
    assert layout.mesh_shape == (1, 2, 1) and (layout.micro_batch, layout.n_micro) == (2, 2)


def test_init_from_gives_the_model_and_the_tokenizer(hf_dir):
    cfg = recipes.get("llama-debug")
    apply_overrides(cfg, ["--checkpoint.init_from", f"hf:{hf_dir}", "--train.seq_len", "64"])
    layout, _ = resolved(cfg, {"checkpoint.init_from", "train.seq_len"}, 2)
    m = layout.model
    assert (m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (64, 4, 2, 96, 384)
    assert m.tie_embeddings and layout.tokenizer == str(hf_dir)
    assert cfg.model.dim == 256 and cfg.data.tokenizer == ""  # the recipe's, untouched
    recorded = layout.recorded(cfg)
    assert recorded["model"]["dim"] == 64 and recorded["data"]["tokenizer"] == str(hf_dir)
    assert recorded["parallel"]["dp_shard"] == 2 and cfg.parallel.dp_shard == -1
    # a --model setting that disagrees with the checkpoint is one error naming both
    names = apply_overrides(cfg, ["--model.dim", "128"])
    with pytest.raises(ConfigError, match="hidden_size=64 but model.dim=128"):
        resolved(cfg, names | {"checkpoint.init_from"}, 2)


def test_plan_auto_chooses_mesh_checkpointing_and_micro_batch():
    cfg = recipes.get("llama3.1-8b")
    apply_overrides(cfg, ["--parallel.plan", "auto"])
    layout, line = resolved(cfg, {"parallel.plan"}, 8, "h100")
    best = best_plan(recipes.get("llama3.1-8b"), 8, 8, profile_for("h100", "cpu"))
    assert layout.mesh_shape == (best.dp_replicate, best.dp_shard, best.tp)
    assert (layout.activation_checkpoint, layout.micro_batch) == (
        best.activation_checkpoint,
        best.micro_batch,
    )
    assert line.startswith("plan auto (h100)") and f"tp={best.tp}" in line
    assert cfg.parallel.tp == recipes.get("llama3.1-8b").parallel.tp


def test_plan_auto_prices_the_init_from_model(hf_dir):
    cfg = recipes.get("llama-debug")
    overrides = ["--parallel.plan", "auto", "--checkpoint.init_from", f"hf:{hf_dir}"]
    apply_overrides(cfg, overrides + ["--train.seq_len", "64"])
    layout, line = resolved(cfg, {"parallel.plan", "checkpoint.init_from", "train.seq_len"}, 4)
    assert line.startswith("plan auto (cpu)") and layout.model.dim == 64 and layout.world == 4
    assert layout.model.n_kv_heads % layout.tp == 0


def test_the_layout_is_frozen_and_owns_the_batch_split():
    cfg = recipes.get("llama-debug")
    cfg.train.global_batch, cfg.train.micro_batch = 12, 0
    layout = RunLayout.build(cfg, 6, dp_replicate=1, tp=2)  # dp_shard -1: 3
    assert (layout.dp, layout.local_batch, layout.micro_batch, layout.n_micro) == (3, 4, 4, 1)
    assert str(layout) == "3x2" and layout.coords(5) == (0, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 1
    assert str(layout.with_choices(cfg, dp_replicate=3, dp_shard=1, micro_batch=2)) == "3x1x2"
    assert mesh_sizes("2x4x8") == {"dp_replicate": 2, "dp_shard": 4, "tp": 8}
    with pytest.raises(ConfigError, match="does not divide the per-rank batch 4"):
        RunLayout.build(cfg, 6, tp=2, micro_batch=3)


def test_a_mesh_error_names_the_sizes_the_launcher_gave(monkeypatch):
    """accelerate's config sets dp_shard=2 and tp=2; --parallel.tp 4 on the command line: the
    error names dp_shard's source, which the user never typed, and not tp's."""
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    cfg = recipes.get("llama-debug")
    names = apply_overrides(cfg, ["--parallel.tp", "4"])
    assert launcher_sizes(names) == {"dp_shard": 2}
    note = "; parallel.dp_shard=2 came from the launcher (PARALLELISM_CONFIG_DP_SHARD_SIZE)"
    assert launcher_sizes_note(names) == note
    with pytest.raises(ConfigError, match=re.escape("1 x 2 x 4") + ".*" + re.escape(note)):
        layout_for_world(cfg, names, 4)
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "two")
    with pytest.raises(ConfigError, match="PARALLELISM_CONFIG_DP_SHARD_SIZE='two' is not an"):
        launcher_sizes(names)
