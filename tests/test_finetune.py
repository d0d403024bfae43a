"""Fine-tuning a HF model: the checkpoint's tokenizer everywhere, sliced dcp: loading, the final
checkpoint by default (docs/finetuning.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hybrid2d.checkpoint.hf import load_pretrained, source_model
from hybrid2d.checkpoint.hf_convert import convert_hf_to_dcp
from hybrid2d.checkpoint.reader import iter_model_tensors
from hybrid2d.config import JobConfig
from hybrid2d.data import build_data
from hybrid2d.data.tokenizer import describe_tokenizer
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.models.llama import Llama
from tests.launch import REPO, check_ok, launcher_env, recipe, recipe_error, recipe_run, run_ranks

transformers = pytest.importorskip("transformers")
from tests.workers.hf_chat import make_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
    """(HF dir with tokenizer and chat template, its DCP conversion, a text file)."""
    root = tmp_path_factory.mktemp("chat")
    hf_dir, dcp_dir = root / "hf", root / "dcp"
    make_chat_model(str(hf_dir))
    convert_hf_to_dcp(str(hf_dir), str(dcp_dir), progress=False)
    text = root / "text.txt"
    text.write_text("def answer():\n    return 42  # the answer\n" * 40)
    return hf_dir, dcp_dir, text


def first_batch(spec: str, text, cache) -> tuple[JobConfig, RunLayout, torch.Tensor]:
    cfg = JobConfig(recipe="test")
    cfg.checkpoint.init_from = spec
    cfg.data.path, cfg.data.cache_dir = str(text), str(cache)
    cfg.train.seq_len, cfg.train.global_batch = 32, 2
    model, tokenizer = source_model(cfg, set())
    layout = RunLayout.build(cfg, 1, model=model, tokenizer=tokenizer)
    loader, _ = build_data(cfg, layout, 0, True, lambda: None)
    return cfg, layout, loader.next_batch()[0][0]


def test_dcp_of_a_converted_dir_trains_with_its_tokenizer(chat_dirs, tmp_path):
    hf_dir, dcp_dir, text = chat_dirs
    _, _, ids_hf = first_batch(f"hf:{hf_dir}", text, tmp_path)
    cfg_dcp, layout, ids_dcp = first_batch(f"dcp:{dcp_dir}", text, tmp_path)
    assert layout.tokenizer == str(dcp_dir) and cfg_dcp.data.tokenizer == ""
    assert torch.equal(ids_hf, ids_dcp)
    assert "stored with checkpoint.init_from" in describe_tokenizer(cfg_dcp, layout)
    assert str(dcp_dir / "tokenizer.json") in describe_tokenizer(cfg_dcp, layout)
    # An explicit data.tokenizer wins.
    cfg = JobConfig(recipe="test")
    cfg.checkpoint.init_from, cfg.data.tokenizer = f"dcp:{dcp_dir}", str(hf_dir)
    assert source_model(cfg, set())[1] == str(hf_dir)


def test_init_from_without_tokenizer_and_no_data_tokenizer_is_an_error(tmp_path):
    hf_dir = tmp_path / "bare"
    make_chat_model(str(hf_dir), tokenizer=False)
    cfg = JobConfig(recipe="test")
    cfg.checkpoint.init_from = f"hf:{hf_dir}"
    with pytest.raises(ConfigError, match="checkpoint.init_from=.*data.tokenizer"):
        source_model(cfg, set())
    error = recipe_error(*cli_args(tmp_path), "--checkpoint.init_from", f"hf:{hf_dir}")
    assert "checkpoint.init_from" in error and "data.tokenizer" in error
    assert not (tmp_path / "run").exists()


def cli_args(tmp_path) -> list[str]:
    """A short run's settings, writing to tmp_path / "run"."""
    return ["--train.seq_len", "32", "--train.global_batch", "4", "--data.max_chars", "100000",
            "--data.cache_dir", str(tmp_path / "cache"), "--metrics.progress_bar", "false",
            "--metrics.run_dir", str(tmp_path / "run")]  # fmt: skip


@pytest.mark.slow
def test_2x2_dcp_reads_only_each_ranks_slices(chat_dirs, tmp_path):
    """init_from dcp: of a converted directory on a 2x2 mesh: each rank reads 24-26% of the
    checkpoint's tensor bytes (as hf: does), and the loaded weights equal the file's."""
    from tests.workers.hf_models import make_hf_model

    hf_dir, dcp_dir = tmp_path / "gqa", tmp_path / "gqa.dcp"
    make_hf_model("gqa-llama3", str(hf_dir))  # vocab 130: uneven 33/32 tp rows
    convert_hf_to_dcp(str(hf_dir), str(dcp_dir), progress=False)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.save(tokens, tmp_path / "tokens.pt")
    out = tmp_path / "out.pt"
    args = ["tests/workers/hf_load.py", str(out), str(tmp_path / "tokens.pt"), "2", "2"]
    check_ok(run_ranks(4, [*args, "gqa", str(hf_dir), str(dcp_dir)], timeout=600))
    results = torch.load(out)
    dcp, hf = results[("gqa", "dcp")], results[("gqa", "hf")]
    total = dcp["checkpoint_bytes"]
    for rank, n in enumerate(dcp["bytes_read"]):
        assert 0.24 * total <= n <= 0.26 * total, f"rank {rank} read {n} of {total} bytes"
    assert sum(dcp["bytes_read"]) >= total
    torch.testing.assert_close(dcp["logits"], hf["logits"], rtol=1e-5, atol=1e-5)
    for name, value in hf["params"].items():
        assert torch.equal(dcp["params"][name], value), name
    print(json.dumps({"dcp_fraction_per_rank": [n / total for n in dcp["bytes_read"]]}))


@pytest.mark.slow
def test_a_resume_does_not_read_init_from_again_and_continues_exactly(chat_dirs, tmp_path):
    """A fine-tune stopped after step 2 and resumed: the resume says init_from is not read (the
    checkpoint holds the weights; each restart of a large job re-read its source), and steps 3-4
    have the uninterrupted run's losses."""
    hf_dir, _, text = chat_dirs

    def run(run_dir, *more):
        return recipe_run(
            run_dir, "--checkpoint.init_from", f"hf:{hf_dir}", "--data.path", str(text),
            "--train.seq_len", "32", "--train.global_batch", "2", "--train.steps", "4",
            "--data.cache_dir", str(tmp_path / "cache"), "--metrics.progress_bar", "false",
            *more,
        )  # fmt: skip

    _, straight = run(tmp_path / "straight")
    first_out, _ = run(tmp_path / "split", "--checkpoint.stop_after", "2")
    assert f"init_from hf:{hf_dir}: " in first_out and " tensors, " in first_out
    out, resumed = run(tmp_path / "split", "--checkpoint.resume", "auto")
    assert f"init_from hf:{hf_dir}: not read, the resumed checkpoint has it" in out, out
    assert " tensors, " not in out, out
    assert resumed["first_step"] == 3
    assert resumed["losses"] == straight["losses"][2:]


@pytest.mark.slow
def test_readme_first_command_leaves_a_checkpoint_generate_reads(tmp_path):
    """README's first command (shortened to 3 steps on less text) saves the final checkpoint by
    default, and tools/generate.py runs/<run> samples from it."""
    from tests.launch import retry_if_port_taken

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           "recipes/accelerate/cpu_2x2.yaml", "--main_process_port", "0", "recipes/llama.py",
           "--train.steps", "3", "--data.max_chars", "200000", "--metrics.run_dir", str(run_dir),
           "--data.cache_dir", str(tmp_path / "cache"),
           "--metrics.progress_bar", "false"]  # fmt: skip
    proc = retry_if_port_taken(
        lambda: subprocess.run(
            cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600
        )
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [c["step"] for c in summary["checkpoints"]] == [3]
    gen = subprocess.run(
        [sys.executable, "tools/generate.py", str(run_dir), "--prompt", "def ",
         "--max-new-tokens", "8", "--json"],
        cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert len(json.loads(gen.stdout)["ids"]) >= 1


def test_generate_chat_renders_the_template_and_matches_transformers(chat_dirs, tmp_path):
    """tools/generate.py --chat: the prompt is the chat template's rendering with the generation
    prompt (as transformers renders it), and greedy ids equal transformers' generate."""
    hf_dir = chat_dirs[0]
    proc = subprocess.run(
        [sys.executable, "tools/generate.py", str(hf_dir), "--chat", "What is the answer?",
         "--system", "Be brief.", "--max-new-tokens", "6", "--no-stop", "--json"],
        cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the answer?"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got["prompt"] == text
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    ids = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert got["ids"] == ref[0, ids.shape[1] :].tolist()
    # A tokenizer without a chat template: one error line, exit 2.
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    bare = subprocess.run(
        [sys.executable, "tools/generate.py", str(hf_dir), "--chat", "hi",
         "--tokenizer", str(tmp_path / "tokenizer.json"), "--max-new-tokens", "2"],
        cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bare.returncode == 2
    lines = [ln for ln in bare.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "has no chat template" in lines[0], bare.stderr


def test_instruction_run_with_validation_reports_everywhere(chat_dirs, tmp_path):
    """One process: instruction data from a converted directory, validation every 2 steps:
    val/loss and val/ppl in TensorBoard, summary.json and the progress bar; truncation and the
    chat template files saved with the checkpoint."""
    import math

    from tests.workers.hf_chat import write_instruction_data

    hf_dir, dcp_dir, _ = chat_dirs
    write_instruction_data(str(tmp_path / "train.jsonl"), 24, seed=0)
    write_instruction_data(str(tmp_path / "val.jsonl"), 5, seed=1)
    proc = recipe([
        *cli_args(tmp_path), "--checkpoint.init_from", f"dcp:{dcp_dir}", "--data.path",
        str(tmp_path / "train.jsonl"), "--data.val_path", str(tmp_path / "val.jsonl"),
        "--train.eval_every", "2", "--train.steps", "4", "--train.seq_len", "64",
        "--metrics.progress_bar", "true",
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stored with checkpoint.init_from" in proc.stdout
    # stderr is no terminal here: progress is a line per step, validation on steps 2 and 4.
    shown = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in shown] == ["1/4", "2/4", "3/4", "4/4"], proc.stdout
    assert ["val_loss" in line for line in shown] == [False, True, False, True], shown
    assert "val_ppl" in shown[3]
    assert "\r" not in proc.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [v["step"] for v in s["val"]] == [2, 4]
    assert s["val_loss"] == s["val"][-1]["loss"]
    assert math.isclose(s["val_ppl"], math.exp(s["val_loss"]), rel_tol=1e-9)
    assert s["data"]["kind"] == "instruct" and s["data"]["train"]["samples"] == 24
    assert s["data"]["train"]["truncated"] >= 1 and s["data"]["val"]["samples"] == 5
    assert "truncated" in proc.stdout and "val loss" in proc.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert {"val/loss", "val/ppl"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4]
    step = tmp_path / "run" / "checkpoints" / "step-0000004"
    assert (step / "tokenizer_config.json").is_file()  # generate --chat works from it
    # init_from a training checkpoint: its shape and its tokenizer.json; the run dir stands for
    # its latest step. Its weights are the step's (a training checkpoint also holds non-tensor
    # entries, which once crashed the sliced load).
    for source in (step, tmp_path / "run"):
        cfg = JobConfig(recipe="test")
        cfg.checkpoint.init_from = f"dcp:{source}"
        model_cfg, tokenizer = source_model(cfg, set())
        assert tokenizer == str(step) and model_cfg.vocab_size == 384
        model = Llama(model_cfg)
        load_pretrained(model, cfg.checkpoint.init_from)
        saved = dict(iter_model_tensors(step))
        params = dict(model.named_parameters())
        assert params and params.keys() <= saved.keys()
        for name, param in params.items():
            assert torch.equal(param, saved[name]), name


def test_init_from_a_path_that_is_no_checkpoint_names_the_setting(tmp_path):
    cfg = JobConfig(recipe="test")
    cfg.checkpoint.init_from = f"dcp:{tmp_path / 'nope'}"
    with pytest.raises(ConfigError) as e:
        source_model(cfg, set())
    assert str(e.value).startswith(f"checkpoint.init_from=dcp:{tmp_path / 'nope'}: "), e.value
    assert "is not a directory" in str(e.value)


@pytest.mark.slow
def test_a_packed_run_resumes_on_another_dp_size_where_it_stopped(chat_dirs, tmp_path):
    """Packed instruction rows (the default): a run on 2 ranks (dp 2) stopped after step 2 and
    resumed on 1 rank continues with the samples a straight run on 2 ranks trains on (the data
    position is a count of samples): the same losses (to 1e-5: another dp size sums in another
    order), and the summaries count the packed rows."""
    from tests.workers.hf_chat import write_instruction_data

    hf_dir, _, _ = chat_dirs
    data = tmp_path / "train.jsonl"
    write_instruction_data(str(data), 40, seed=2)

    def run(ranks, run_dir, *more):
        return recipe_run(
            run_dir, "--checkpoint.init_from", f"hf:{hf_dir}", "--data.path", str(data),
            "--train.seq_len", "128", "--train.global_batch", "4", "--train.steps", "4",
            "--data.cache_dir", str(tmp_path / "cache"), "--metrics.progress_bar", "false",
            *more, ranks=ranks,
        )[1]  # fmt: skip

    straight = run(2, tmp_path / "straight")
    first = run(2, tmp_path / "split", "--checkpoint.stop_after", "2")
    resumed = run(1, tmp_path / "split", "--checkpoint.resume", "auto")
    assert resumed["first_step"] == 3 and resumed["mesh"]["dp_shard"] == 1
    for got, want in zip(resumed["losses"], straight["losses"][2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed["losses"], straight["losses"])
    packing = straight["data"]["packing"]
    assert straight["data"]["layout"] == "packed" and packing["rows"] == 16
    assert packing["samples_per_row"] > 1
    split = first["data"]["packing"]["samples"] + resumed["data"]["packing"]["samples"]
    assert split == packing["samples"]
    assert straight["tokens_per_s"] < straight["positions_per_s"]  # padding is not counted
