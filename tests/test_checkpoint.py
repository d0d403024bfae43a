"""Checkpoint pieces in one process: directory layout, retention, checksums, reading, bad input.

The multi-process runs (exact resume, resharding, async, kill -9, export, generate) are in
tests/test_checkpoint_runs.py.
"""

import importlib.util
import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybrid2d.checkpoint import integrity, layout, standalone
from hybrid2d.checkpoint.dcp import find_resume, save_due, verify_files
from hybrid2d.checkpoint.reader import (
    check_model_shapes,
    expected_model_shapes,
    iter_model_tensors,
    read_metadata,
)
from hybrid2d.config import CheckpointConfig, JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.models.llama import Llama
from tests.launch import REPO
from tests.reference import tiny_config


def fake_save(run_dir, step, payload=b"x"):
    """What a finished DCP write leaves: step-N.tmp with a .metadata and a data file."""
    tmp = layout.tmp_dir(run_dir, step)
    tmp.mkdir(parents=True)
    (tmp / layout.METADATA).write_bytes(payload)
    (tmp / "__0_0.distcp").write_bytes(payload * 10)
    return tmp


# ---- layout ----------------------------------------------------------------------------------


def test_publish_renames_then_points_latest_and_retention_keeps_exactly_keep_last(tmp_path):
    ckpts = layout.checkpoints_dir(tmp_path)
    for step in (5, 10, 15, 20):
        fake_save(tmp_path, step)
        final = layout.publish(tmp_path, step)
        assert final == ckpts / f"step-{step:07d}" and final.is_dir()
        assert not layout.tmp_dir(tmp_path, step).exists()
        assert (ckpts / "latest").read_text().strip() == final.name
        layout.apply_retention(tmp_path, keep_last=2)
    # A save that died before publishing, and leftovers, are cleaned up by the next retention.
    fake_save(tmp_path, 25)
    layout.apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000015", "step-0000020"]


def test_publish_replaces_a_superseded_step_directory(tmp_path):
    fake_save(tmp_path, 10, b"old")
    layout.publish(tmp_path, 10)
    fake_save(tmp_path, 10, b"new")
    final = layout.publish(tmp_path, 10)
    assert (final / layout.METADATA).read_bytes() == b"new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["latest", "step-0000010"]


def test_latest_pointer_wins_and_missing_pointer_falls_back_to_newest(tmp_path):
    for step in (5, 10):
        fake_save(tmp_path, step)
        layout.publish(tmp_path, step)
    ckpts = layout.checkpoints_dir(tmp_path)
    (ckpts / "latest").write_text("step-0000005\n")
    assert layout.latest_in_run(tmp_path) == ckpts / "step-0000005"
    (ckpts / "latest").unlink()  # killed between the rename and the pointer update
    assert layout.latest_in_run(tmp_path) == ckpts / "step-0000010"
    (ckpts / "latest").write_text("step-0000099\n")
    with pytest.raises(ConfigError, match="names 'step-0000099'"):
        layout.latest_in_run(tmp_path)
    assert layout.latest_in_run(tmp_path / "fresh-run") is None


def test_resolve_accepts_step_checkpoints_and_run_directories(tmp_path):
    fake_save(tmp_path, 10)
    step = layout.publish(tmp_path, 10)
    for given in (step, step.parent, tmp_path):
        assert layout.resolve(str(given)) == step


@pytest.mark.parametrize("case", ["missing", "file", "empty", "unfinished"])
def test_resolve_bad_paths_name_the_problem(tmp_path, case):
    target = {
        "missing": tmp_path / "nope",
        "file": tmp_path / "f.txt",
        "empty": tmp_path / "empty",
        "unfinished": layout.tmp_dir(tmp_path, 10),
    }[case]
    if case == "file":
        target.write_text("hi")
    elif case == "empty":
        target.mkdir()
    elif case == "unfinished":
        fake_save(tmp_path, 10)
    expected = {
        "missing": "does not exist",
        "file": "is a file, not a checkpoint directory",
        "empty": "is not a checkpoint directory",
        "unfinished": "is an unfinished save",
    }[case]
    with pytest.raises(ConfigError, match=expected) as e:
        layout.resolve(str(target))
    assert "\n" not in str(e.value)


def test_auto_resume_finds_the_newest_run_with_a_checkpoint(tmp_path):
    template = str(tmp_path / "runs" / "{recipe}-{time}")
    assert layout.find_run_to_resume(template, "tiny") is None
    old = tmp_path / "runs" / "tiny-20260101-000000"
    fake_save(old, 5)
    layout.publish(old, 5)
    newer = tmp_path / "runs" / "tiny-20260102-000000"  # started, no checkpoint yet
    newer.mkdir(parents=True)
    other = tmp_path / "runs" / "other-20260103-000000"  # another recipe
    fake_save(other, 5)
    layout.publish(other, 5)
    assert layout.find_run_to_resume(template, "tiny") == str(old)
    # A fixed run directory (no {time}) is its own candidate.
    assert layout.find_run_to_resume(str(old), "tiny") == str(old)


# ---- a real DCP checkpoint written in this process (model only, as the HF converter does) -----


@pytest.fixture
def model_ckpt(tmp_path):
    cfg = tiny_config()
    model = Llama(cfg.model)
    model.init_weights(3)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    (path / layout.CONFIG).write_text(json.dumps(cfg.to_dict()))
    return path, cfg, state


def test_iter_model_tensors_returns_the_saved_tensors(model_ckpt):
    path, _, state = model_ckpt
    got = dict(iter_model_tensors(path))
    assert list(got) == list(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    bf16 = dict(iter_model_tensors(path, dtype=torch.bfloat16))
    assert torch.equal(bf16["lm_head.weight"], state["lm_head.weight"].bfloat16())


def test_shape_mismatch_names_first_key_and_both_shapes(model_ckpt):
    path, cfg, _ = model_ckpt
    meta = read_metadata(path)
    wider = JobConfig.from_dict(cfg.to_dict()).model
    wider.dim = 128
    with pytest.raises(ConfigError) as e:
        check_model_shapes(path, meta, expected_model_shapes(wider), wider)
    msg = str(e.value)
    assert "model.embed_tokens.weight has shape [256, 64] in the checkpoint but [256, 128]" in msg
    assert "model.dim=64 there, 128 here" in msg
    deeper = JobConfig.from_dict(cfg.to_dict()).model
    deeper.n_layers = 3
    with pytest.raises(ConfigError, match="it has no tensor model.layers.2.input_layernorm.weight"):
        check_model_shapes(path, meta, expected_model_shapes(deeper), deeper)
    shallower = JobConfig.from_dict(cfg.to_dict()).model
    shallower.n_layers = 1
    with pytest.raises(ConfigError, match="it has model.layers.1.input_layernorm.weight .* lacks"):
        check_model_shapes(path, meta, expected_model_shapes(shallower), shallower)


def test_resume_from_a_model_only_checkpoint_points_to_init_from(model_ckpt):
    path, cfg, _ = model_ckpt
    cfg.checkpoint.resume = str(path)
    with pytest.raises(ConfigError, match="holds no training state.*init_from dcp:PATH"):
        find_resume(cfg, path.parent)


def test_damaged_metadata_is_one_clear_error(model_ckpt):
    path, cfg, _ = model_ckpt
    meta = path / layout.METADATA
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    cfg.checkpoint.resume = str(path)
    with pytest.raises(ConfigError, match="cannot be read .*truncated or corrupted"):
        find_resume(cfg, path.parent)


def test_deleted_metadata_is_called_damaged_not_foreign(model_ckpt):
    path, _, _ = model_ckpt
    (path / layout.METADATA).unlink()
    with pytest.raises(ConfigError, match="is damaged: it has .distcp data files but no .metadata"):
        read_metadata(path)


def test_missing_checksums_is_said_before_loading_unverified(model_ckpt, capsys):
    path, _, _ = model_ckpt
    integrity.write(path, integrity.describe(path, integrity.checkpoint_files(path)))
    verify_files(path, 0, 1)
    assert "unverified" not in capsys.readouterr().out
    (path / layout.CHECKSUMS).unlink()
    verify_files(path, 0, 1)
    assert f"checkpoint {path} has no checksums.json; its files are loaded unverified" in (
        capsys.readouterr().out
    )


def test_truncated_data_file_without_checksums_is_one_clear_error(model_ckpt):
    path, _, _ = model_ckpt
    data = next(path.glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 3)
    with pytest.raises(ConfigError, match="cannot be read .*truncated or corrupted"):
        dict(iter_model_tensors(path))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_checksums_catch_corruption_dcp_would_load_silently(model_ckpt, damage):
    path, _, state = model_ckpt
    names = integrity.checkpoint_files(path)
    integrity.write(path, integrity.describe(path, names))
    standalone.verify(path)  # intact: passes
    data = next(path.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    if damage == "flip":
        # A byte inside lm_head.weight's values: DCP itself loads this without complaint.
        target = state["lm_head.weight"][0, 0].numpy().tobytes()
        at = bytes(blob).find(target)
        assert at > 0
        blob[at + 3] ^= 0x40
        data.write_bytes(bytes(blob))
        loaded = dict(iter_model_tensors(path))["lm_head.weight"]
        assert not torch.equal(loaded, state["lm_head.weight"])
        expected = f"{data.name} has CRC-32 .*corrupted"
    elif damage == "truncate":
        data.write_bytes(bytes(blob[:-100]))
        expected = f"{data.name} is {len(blob) - 100} bytes, {len(blob)} when saved"
    else:
        data.unlink()
        expected = f"{data.name} is missing"
    with pytest.raises(ConfigError, match=expected):
        standalone.verify(path)


def test_standalone_loads_a_plain_model_equal_to_the_saved_one(model_ckpt):
    path, cfg, state = model_ckpt
    model, mcfg = standalone.load_model(standalone.locate(str(path)))
    assert mcfg == cfg.model
    ref = Llama(cfg.model)
    ref.load_state_dict(state)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


# ---- sampling --------------------------------------------------------------------------------


def _generate_module():
    spec = importlib.util.spec_from_file_location("gen", os.path.join(REPO, "tools/generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FixedLogits(torch.nn.Module):
    """Logits that depend only on the last token: next = (last + 1) % V is the likeliest."""

    def __init__(self, vocab=16):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens):
        last = tokens[:, -1:]
        ranks = (torch.arange(self.vocab) - last - 1) % self.vocab  # 0 for last + 1
        return (-ranks.float())[:, None, :].expand(tokens.shape[0], tokens.shape[1], -1)


def test_sampling_greedy_top_k_and_seed():
    gen = _generate_module()
    model = FixedLogits()
    assert gen.sample(model, [3], 4) == [4, 5, 6, 7]
    assert gen.sample(model, [3], 10, stop_id=6) == [4, 5, 6]
    # top-1 sampling is greedy at any temperature; top-k never leaves the k likeliest.
    assert gen.sample(model, [3], 4, temperature=5.0, top_k=1, seed=7) == [4, 5, 6, 7]
    seen = gen.sample(model, [0], 200, temperature=100.0, top_k=3, seed=1)
    prev = [0] + seen[:-1]
    assert all((s - p - 1) % 16 < 3 for s, p in zip(seen, prev, strict=True))
    assert len({(s - p - 1) % 16 for s, p in zip(seen, prev, strict=True)}) == 3
    a = gen.sample(model, [0], 30, temperature=2.0, seed=5)
    assert a == gen.sample(model, [0], 30, temperature=2.0, seed=5)
    assert a != gen.sample(model, [0], 30, temperature=2.0, seed=6)


@pytest.mark.parametrize(
    "every, save_final, stop_after, saved",
    [
        (0, True, 0, [20]),
        (0, False, 0, []),
        (5, True, 0, [5, 10, 15, 20]),
        (8, True, 0, [8, 16, 20]),
        (8, False, 0, [8, 16]),  # README: `--checkpoint.save_final false` for none at the end
        (500, False, 0, []),  # the 1B recipe's every=500 in a 20-step GPU check
        (0, False, 7, [7]),
    ],
)
def test_saved_steps_follow_every_save_final_and_stop_after(every, save_final, stop_after, saved):
    ck = CheckpointConfig(every=every, save_final=save_final, stop_after=stop_after)
    assert [step for step in range(1, 21) if save_due(ck, 20, step)] == saved


def test_a_resume_names_the_settings_changed_since_its_checkpoint():
    """Resuming with other data or batch settings is allowed (the data position carries over),
    but said: it went unnoticed before. The step count, micro batch and mesh are free."""
    from hybrid2d.checkpoint.dcp import changed_since
    from hybrid2d.config import JobConfig

    saved, now = JobConfig(), JobConfig()
    assert changed_since(saved, now) == [] and changed_since(None, now) == []
    now.train.steps, now.train.micro_batch, now.parallel.tp = 99, 2, 2
    assert changed_since(saved, now) == []
    now.train.seq_len, now.data.path = 32, "val.jsonl"
    assert changed_since(saved, now) == [
        f"train.seq_len {saved.train.seq_len} -> 32",
        "data.path '' -> 'val.jsonl'",
    ]


def test_a_failed_save_on_a_nearly_full_filesystem_says_so(tmp_path, monkeypatch):
    """torch's writer reports a full disk as 'unexpected pos 704 vs 598': the line adds the free
    space where it is nearly none, and nothing where there is room."""
    import shutil as shutil_module
    from collections import namedtuple

    from hybrid2d.checkpoint import dcp as dcp_module

    usage = namedtuple("usage", "total used free")
    ck = dcp_module.Checkpointer.__new__(dcp_module.Checkpointer)
    ck.rank = 0
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    tmp = tmp_path / "step-0000004.tmp"
    for free, said in ((3 << 20, "its filesystem has 3.0 MiB free: full?"), (10 << 30, None)):
        monkeypatch.setattr(shutil_module, "disk_usage", lambda _, free=free: usage(0, 0, free))
        line = ck._failure("sync", 4, tmp, error)
        assert line.startswith("rank 0: sync checkpoint save of step 4 failed: RuntimeError")
        assert (said in line) if said else ("free" not in line), line


# ---- the Checkpointer over plain state objects (no trainer) ----------------------------------


class Progress:
    """A stand-in for the trainer's progress: the step the layout needs, and a tensor."""

    def __init__(self, step, value):
        self.step, self.value = step, torch.tensor(value)

    def state_dict(self):
        return {"step": self.step, "value": self.value.clone()}

    def load_state_dict(self, state):
        self.step, self.value = int(state["step"]), state["value"].clone()


class Position:
    """A stand-in for the data loader (which has the same two methods)."""

    def __init__(self, consumed):
        self.consumed = consumed

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = int(state["consumed"])


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo process group, as the Checkpointer's collectives need one."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_states(seed, step, consumed):
    """Model, optimizer (SGD with momentum: it has state), progress and data position."""
    from hybrid2d.checkpoint.state import ModelState, OptimizerState

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    states = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, opt),
        "trainer": Progress(step, float(seed)),
        "trainer.data": Position(consumed),
    }
    return states, model, opt


def test_the_checkpointer_saves_and_loads_plain_state_objects_without_a_trainer(
    tmp_path, one_rank, capsys
):
    """What is saved is each object's state_dict at its place (trainer.data inside trainer, the
    layout resumes and the HF converter read); a load gives each object back its own."""
    from hybrid2d.checkpoint.dcp import Checkpointer

    cfg = tiny_config(steps=10)
    saved, model, opt = make_states(1, 4, 32)
    ck = Checkpointer(cfg, tmp_path, saved)
    ck.save(4)
    ck.close()
    path = layout.latest_in_run(tmp_path)
    assert path == layout.final_dir(tmp_path, 4)
    keys = set(read_metadata(path).state_dict_metadata)
    assert {"trainer.step", "trainer.value", "trainer.data.consumed", "model.weight"} <= keys
    assert any(k.startswith("optimizer.state.weight.momentum_buffer") for k in keys)

    fresh, model2, opt2 = make_states(2, 0, 0)
    assert not torch.equal(model.weight, model2.weight)
    assert Checkpointer(cfg, tmp_path, fresh).load(path) == 4
    assert "resumed from" in capsys.readouterr().out
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    assert torch.equal(
        opt2.state[model2.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )
    assert (fresh["trainer"].step, fresh["trainer"].value.item()) == (4, 1.0)
    assert fresh["trainer.data"].consumed == 32
