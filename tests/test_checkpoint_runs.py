"""Checkpoints in real multi-process training runs (CPU, gloo, fp32).

One straight 20-step run on (dp=2, tp=2), saving asynchronously, is the reference. Against it:
the same run with sync saves whose rank 1 is SIGKILLed inside the save of step 15, then resumed
with `auto` from step 10 (identical losses); that step-10 checkpoint resumed on (4,1), (1,4) and
(1,2) (losses to 1e-5, AdamW state resharded) and compared tensor for tensor with the async
one; export and generation against transformers; bad checkpoints, one error line on every rank.
"""

import importlib.util
import json
import os
import shutil
import time

import pytest
import torch

from hybrid2d.checkpoint import layout
from hybrid2d.errors import ConfigError
from tests.launch import REPO, check_ok, run_ranks

pytestmark = pytest.mark.slow

STEPS = 20
# tests/reference.py's tiny model, with 512 tokens: a byte-level BPE needs more than 256.
TINY = {
    "model.dim": 64,
    "model.n_layers": 2,
    "model.n_heads": 8,
    "model.n_kv_heads": 4,
    "model.ffn_dim": 128,
    "model.vocab_size": 512,
    "train.seq_len": 16,
    "train.global_batch": 8,
    "train.steps": STEPS,
    "train.warmup_steps": 2,
    "train.seed": 3,
    "data.max_chars": 200_000,
    "metrics.progress_bar": "false",
    "metrics.tensorboard": "false",
}


def args_for(cache, run_dir, dp=2, tp=2, **settings):
    """Command line of the tiny run; settings: `every=5` means --checkpoint.every 5, and
    `parallel__timeout_s=30` means --parallel.timeout_s 30."""
    merged = {**TINY, "data.cache_dir": cache, "metrics.run_dir": run_dir}
    merged.update({"parallel.tp": tp, "parallel.dp_shard": dp})
    for k, v in settings.items():
        merged[k.replace("__", ".") if "__" in k else f"checkpoint.{k}"] = v
    out = []
    for k, v in merged.items():
        out += [f"--{k}", str(v)]
    return out


def train(world, args, script="recipes/llama.py", timeout=400, ok=True):
    results = run_ranks(world, [*script.split(), *args], timeout=timeout)
    if ok:
        check_ok(results)
    return results


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def steps_in(run_dir):
    return layout.complete_steps(layout.checkpoints_dir(run_dir))


def assert_close(got, ref, rtol=1e-5):
    assert len(got) == len(ref), (got, ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"loss {i}: {a} vs straight run {b}"


def full_state(step_dir, tmp_path):
    """Everything in a DCP checkpoint, read by torch's own converter (not hybrid2d's reader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=False)


def assert_same_tree(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}.{i}")
    else:
        assert a == b, where


# ---- the runs everything is compared against -------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """20 steps on (2, 2), async saves every 5 steps, each write held back until training has
    gone past its step (tests/workers/ckpt_slow_writer.py; its log is run/../writes.log)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    args = args_for(cache, run, every=5, keep_last=3, async_save="true")
    train(4, args, f"tests/workers/ckpt_slow_writer.py {run.parent / 'writes.log'}")
    return run


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, cache):
    """The same run with sync saves, rank 1 SIGKILLed inside the save of step 15 (after it wrote
    its files, before the checkpoint is published). Returns (run dir, per-rank results, seconds)."""
    run = tmp_path_factory.mktemp("crashed") / "run"
    args = args_for(cache, run, every=5, keep_last=3, parallel__timeout_s=30)
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRID2D_TEST_KILL_IN_SAVE", "15:1")  # read by hybrid2d/checkpoint/dcp.py
        results = train(4, args, timeout=240, ok=False)
    return run, results, time.perf_counter() - start


# ---- save, retention, async ------------------------------------------------------------------


def test_retention_keeps_exactly_keep_last_and_latest_is_the_newest(straight):
    ckpts = layout.checkpoints_dir(straight)
    assert steps_in(straight) == [10, 15, 20]
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "latest",
        "step-0000010",
        "step-0000015",
        "step-0000020",
    ]
    assert (ckpts / "latest").read_text().strip() == "step-0000020"
    for step in (10, 15, 20):
        d = layout.final_dir(straight, step)
        names = {p.name for p in d.iterdir()}
        assert {".metadata", "checksums.json", "config.json", "tokenizer.json"} <= names
        assert sum(n.endswith(".distcp") for n in names) == 4  # one file per rank
    s = summary(straight)
    assert [c["step"] for c in s["checkpoints"]] == [5, 10, 15, 20]


def test_async_save_lets_training_go_on_and_writes_the_same_tensors_as_sync(
    straight, crashed, tmp_path
):
    # Every rank began writing steps 5, 10 and 15 only after it had trained a later step:
    # the save call had returned and training went on while the write was pending.
    writes = [ln.split() for ln in (straight.parent / "writes.log").read_text().splitlines()]
    began = {(int(r), int(s)): int(t) for r, s, t in writes}
    assert sorted(began) == [(r, s) for r in range(4) for s in (5, 10, 15, 20)], writes
    for (rank, step), trained in began.items():
        assert trained > step or step == STEPS, (rank, step, trained)
    for c in summary(straight)["checkpoints"]:
        assert c["blocking_s"] < c["total_s"], c
    # Steps 11.. ran while step 10's write was held back: had the async save not copied the
    # state first, the files would hold later weights and optimizer moments.
    run, _, _ = crashed
    async_state = full_state(layout.final_dir(straight, 10), tmp_path)
    sync_state = full_state(layout.final_dir(run, 10), tmp_path)
    assert set(async_state) == {"model", "optimizer", "trainer"}
    assert async_state["trainer"]["step"] == 10
    data_state = {"samples_consumed": 80, "seed": 3, "shuffle_block": 8192}
    assert async_state["trainer"]["data"] == data_state
    assert_same_tree(async_state, sync_state)


# ---- kill -9, resume -------------------------------------------------------------------------


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(crashed):
    run, results, _ = crashed
    assert results[1].returncode == -9, results[1].stderr[-2000:]
    # The other ranks notice the dead peer and exit instead of waiting forever.
    # (run_ranks' timeout is the hang guard: a rank still waiting there fails the fixture.)
    assert all(r.returncode not in (0, None) for r in results), [r.returncode for r in results]
    ckpts = layout.checkpoints_dir(run)
    assert (ckpts / "latest").read_text().strip() == "step-0000010"
    assert layout.tmp_dir(run, 15).is_dir() and not layout.final_dir(run, 15).exists()


def test_resume_auto_after_the_kill_is_exact(straight, crashed, cache):
    # 10 steps + kill + resume + 10 steps: the same losses as 20 straight steps, bit for bit.
    run, _, _ = crashed
    train(4, args_for(cache, run, every=5, keep_last=3, resume="auto"))
    r = summary(run)
    assert r["resumed_from"] == str(layout.final_dir(run, 10))
    assert r["steps"] == STEPS
    assert r["losses"] == summary(straight)["losses"][10:]
    # The unfinished step-15.tmp is gone; 15 and 20 were saved anew; keep_last holds.
    assert sorted(p.name for p in layout.checkpoints_dir(run).iterdir()) == [
        "latest",
        "step-0000010",
        "step-0000015",
        "step-0000020",
    ]


RESHARD = [(4, 1, 4), (1, 4, 4), (1, 2, 2)]  # (dp, tp, processes)


@pytest.mark.parametrize("dp,tp,world", RESHARD, ids=[f"dp{d}xtp{t}" for d, t, _ in RESHARD])
def test_resume_on_another_mesh_and_world_size(straight, crashed, cache, tmp_path, dp, tp, world):
    run = tmp_path / "run"
    ckpt = layout.final_dir(crashed[0], 10)  # saved by 4 processes on (2, 2)
    # The 2-process resume also stops (and saves) after step 15: checkpoint.stop_after.
    stop = {"stop_after": 15} if world == 2 else {}
    train(world, args_for(cache, run, dp=dp, tp=tp, resume=str(ckpt), **stop))
    r = summary(run)
    assert r["mesh"] == {"dp_replicate": 1, "dp_shard": dp, "tp": tp}
    assert r["resumed_from"] == str(ckpt)
    end = 15 if stop else STEPS
    assert r["steps"] == end
    assert_close(r["losses"], summary(straight)["losses"][10:end])
    if stop:
        assert steps_in(run) == [15]
        assert r["checkpoints"][0]["step"] == 15


def test_resume_with_another_lr_and_length_trains_at_the_new_schedule(crashed, cache, tmp_path):
    """The step-10 checkpoint (lr 3e-3 over 20 steps) resumed with --train.lr 1e-3 over 30 steps:
    each step's lr is 1e-3 times the 30-step schedule at that step, from the first one on. It
    used to be the checkpoint's base lr (3x) throughout, and the old schedule's on step 11."""
    from hybrid2d.config import TrainConfig
    from hybrid2d.optim import lr_multiplier

    run = tmp_path / "run"
    args = args_for(cache, run, dp=1, tp=2, resume=str(layout.final_dir(crashed[0], 10)))
    args += ["--train.lr", "1e-3", "--train.steps", "30", "--checkpoint.stop_after", "12"]
    args += ["--metrics.progress_bar", "true"]  # step lines on stdout (no terminal)
    out = train(2, args)[0].stdout
    assert "train.lr 0.003 -> 0.001" in out, out
    new = TrainConfig(lr=1e-3, steps=30, warmup_steps=TINY["train.warmup_steps"])
    for step in (11, 12):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"step {step}/30 "))
        shown = float(line.split("  lr ")[1].split()[0])
        assert shown == pytest.approx(1e-3 * lr_multiplier(step - 1, new), rel=6e-3), line


def test_a_resume_whose_data_settings_train_another_tokenizer_is_refused(crashed, cache, tmp_path):
    """Another data.max_chars trains another BPE: the checkpoint's token ids would stand for other
    text. It resumed silently (a 'settings changed' line); now it is refused, and the checkpoint's
    own tokenizer.json, named in the error, resumes."""
    step = layout.final_dir(crashed[0], 10)
    args = args_for(cache, tmp_path / "run", dp=1, tp=1, resume=str(step))
    args += ["--train.steps", "11", "--checkpoint.save_final", "false"]
    other = ["--data.max_chars", str(int(TINY["data.max_chars"]) // 2)]
    line = one_error_line(train(1, args + other, ok=False)[0])
    assert "another tokenizer" in line and f"--data.tokenizer {step}" in line, line
    # A stop_after behind the resumed step cannot stop this run: said, not silently passed by.
    fixed = ["--data.tokenizer", str(step), "--checkpoint.stop_after", "5"]
    out = train(1, args + other + fixed)[0].stdout
    assert f"resumed from {step} at step 10" in out, out
    assert "checkpoint.stop_after=5 is not after the resumed step 10" in out, out


# ---- bad checkpoints -------------------------------------------------------------------------


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def test_bad_resume_paths_fail_on_every_rank(cache, tmp_path):
    results = train(
        2, args_for(cache, tmp_path / "run", dp=1, tp=2, resume=str(tmp_path / "nope")), ok=False
    )
    assert [r.returncode for r in results] == [2, 2]
    assert "does not exist" in one_error_line(results[0])


def test_corrupted_file_seen_by_one_rank_fails_every_rank(crashed, cache, tmp_path):
    # Each rank hashes a share of the files; __2_0.distcp falls to rank 1 of 2. Both must stop
    # with its message instead of rank 0 going on to a collective alone.
    bad = tmp_path / "bad"
    shutil.copytree(layout.final_dir(crashed[0], 10), bad)
    data = bad / "__2_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    results = train(2, args_for(cache, tmp_path / "run", dp=1, tp=2, resume=str(bad)), ok=False)
    assert [r.returncode for r in results] == [2, 2]
    line = one_error_line(results[0])
    assert "__2_0.distcp has CRC-32" in line and "corrupted" in line
    assert "Traceback" not in results[1].stderr


def test_checkpoint_of_another_shape_names_the_key_and_shapes(crashed):
    from hybrid2d.checkpoint.dcp import find_resume
    from hybrid2d.config import JobConfig

    step = layout.final_dir(crashed[0], 10)
    cfg = JobConfig.from_dict(json.loads((step / "config.json").read_text()))
    cfg.model.ffn_dim = 256
    cfg.checkpoint.resume = str(step)
    with pytest.raises(ConfigError) as e:
        find_resume(cfg, step.parent.parent)
    assert (
        "model.layers.0.mlp.gate_proj.weight has shape [128, 64] in the checkpoint but [256, 64] "
        "here (model.ffn_dim=128 there, 256 here)"
    ) in str(e.value)


def test_resume_of_a_finished_run_says_there_is_nothing_left(crashed):
    from hybrid2d.checkpoint.dcp import find_resume
    from hybrid2d.config import JobConfig

    step = layout.final_dir(crashed[0], 10)
    cfg = JobConfig.from_dict(json.loads((step / "config.json").read_text()))
    cfg.train.steps = 10
    cfg.checkpoint.resume = str(step)
    with pytest.raises(ConfigError, match="is at step 10, train.steps=10: nothing left to train"):
        find_resume(cfg, step.parent.parent)


# ---- export and generate ---------------------------------------------------------------------


def tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def exported(straight, tmp_path_factory):
    """tools/export_checkpoint.py of the straight run's directory (its latest: step 20), fp32."""
    out = tmp_path_factory.mktemp("export") / "fp32"
    assert tool("export_checkpoint").main([str(straight), str(out), "--no-progress"]) == 0
    return out


def test_export_writes_the_dcp_tensors_and_transformers_loads_it(
    straight, exported, tmp_path, capsys
):
    from safetensors.torch import load_file

    export = tool("export_checkpoint")
    out32, out16 = exported, tmp_path / "bf16"
    step = layout.final_dir(straight, 20)
    assert export.main([str(step), str(out16), "--dtype", "bf16", "--no-progress"]) == 0
    assert str(step) in capsys.readouterr().out
    ref = full_state(layout.final_dir(straight, 20), tmp_path)["model"]
    got32 = load_file(out32 / "model.safetensors")
    got16 = load_file(out16 / "model.safetensors")
    assert set(got32) == set(ref) == set(got16)
    for k, v in ref.items():
        assert got32[k].dtype == torch.float32 and torch.equal(got32[k], v), k
        assert got16[k].dtype == torch.bfloat16 and torch.equal(got16[k], v.bfloat16()), k
    assert {p.name for p in out32.iterdir()} == {
        "model.safetensors",
        "config.json",
        "hybrid2d_config.json",
        "tokenizer.json",
        "tokenizer_config.json",  # written for the project's BPE, which has none
        "generation_config.json",
    }

    transformers = pytest.importorskip("transformers")
    from hybrid2d.config import JobConfig
    from hybrid2d.models.llama import Llama

    hf = transformers.LlamaForCausalLM.from_pretrained(str(out32)).eval()
    ours = Llama(
        JobConfig.from_dict(json.loads((out32 / "hybrid2d_config.json").read_text())).model
    )
    ours.load_state_dict(ref)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_generate_from_dcp_and_export_agree_with_transformers(straight, exported, capsys):
    transformers = pytest.importorskip("transformers")
    gen, out = tool("generate"), exported
    capsys.readouterr()
    prompt = ["--prompt", "def ", "--max-new-tokens", "24", "--no-stop", "--json"]
    assert gen.main([str(straight), *prompt]) == 0
    from_dcp = json.loads(capsys.readouterr().out)
    assert gen.main([str(out), *prompt]) == 0
    from_export = json.loads(capsys.readouterr().out)
    assert from_dcp == from_export and len(from_dcp["ids"]) == 24

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([tok.encode("def ").ids])
    hf_ids = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf_ids[0, ids.shape[1] :].tolist() == from_dcp["ids"]


def test_generate_prints_text_from_a_trained_checkpoint(straight, capsys):
    gen = tool("generate")
    args = ["--prompt", "def ", "--max-new-tokens", "40", "--temperature", "0.8", "--top-k", "20"]
    assert gen.main([str(straight), *args, "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.strip()) > len("def ") + 10
    assert gen.main([str(straight), *args, "--seed", "2"]) == 0
    assert capsys.readouterr().out != text  # sampled, not greedy


@pytest.mark.parametrize("which", ["export_checkpoint", "generate"])
def test_tools_refuse_bad_checkpoints_with_one_line(straight, tmp_path, capsys, which):
    mod = tool(which)
    extra = [str(tmp_path / "out")] if which == "export_checkpoint" else []
    assert mod.main([str(tmp_path / "missing"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "does not exist" in err and "\n" not in err
    bad = tmp_path / "bad"
    shutil.copytree(layout.final_dir(straight, 15), bad)
    with open(bad / "__3_0.distcp", "r+b") as f:
        f.truncate(1000)
    assert mod.main([str(bad), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "__3_0.distcp is 1000 bytes" in err and "\n" not in err


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_generate_refuses_a_temperature_that_is_not_a_finite_number_from_0(
    tmp_path, capsys, temperature
):
    """Checked before the checkpoint is read: nan ended in torch.multinomial's traceback, inf
    sampled uniformly."""
    with pytest.raises(SystemExit) as e:
        tool("generate").main([str(tmp_path), "--prompt", "a", "--temperature", temperature])
    assert e.value.code == 2
    assert "--temperature" in capsys.readouterr().err
