"""Exports of training checkpoints carry the special token ids (hybrid2d/checkpoint/hf_tokens.py):
config.json's bos/eos/pad_token_id and a generation_config.json that stops at the chat template's
end-of-turn token and the end-of-text token, as tools/generate.py does.

Until 2026-12: a fine-tuned checkpoint exported with tools/export_checkpoint.py had no token ids
in config.json (transformers assumed Llama's bos 1 where the source had 0) and no
generation_config.json, so transformers' `generate` ran past <|im_end|> to max_new_tokens.

The fast tests write training checkpoints in-process the way the Checkpointer does (DCP "model"
entry, the run's config.json, tokenizer.json and the tokenizer's side files); the slow one
fine-tunes with recipes/llama.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hybrid2d.checkpoint import integrity, layout
from hybrid2d.checkpoint.hf import model_config_from_hf
from hybrid2d.checkpoint.hf_convert import convert_hf_to_dcp
from hybrid2d.checkpoint.hf_tokens import SOURCE_CONFIG, source_files
from hybrid2d.config import JobConfig
from hybrid2d.data.chat import load_chat_template, tokenizer_side_files
from hybrid2d.data.tokenizer import train_bpe
from tests.launch import REPO, launcher_env

transformers = pytest.importorskip("transformers")
from tests.workers.hf_chat import make_chat_model  # noqa: E402

VOCAB = 512
# The user's model: bos 0 (<|endoftext|> in make_tokenizer's vocabulary), eos 2 (<|im_end|>).
SOURCE_IDS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}
END_OF_TEXT, IM_END = 0, 2
TOKEN_KEYS = tuple(SOURCE_IDS)
QUESTIONS = [f"What is {i}?" for i in range(10, 18)]
MAX_NEW = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: two threads on a busy 2-core host take 100x longer than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_source(path: Path, **ids):
    """A tiny random LlamaForCausalLM (GQA 4/2, tied embeddings) with bos/eos/pad `ids`, and a
    ChatML tokenizer whose tokenizer_config.json names eos <|im_end|> and pad <|endoftext|>."""
    model = make_chat_model(str(path), vocab=VOCAB, **(SOURCE_IDS | ids))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")] == [END_OF_TEXT, IM_END]
    return model


def chat(question: str, answer: str | None = None) -> list[dict]:
    turns = [{"role": "user", "content": question}]
    return turns + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def fine_tune(model, tok_dir: Path, steps: int = 100):
    """Teach the model to answer every question with 'ok<|im_end|>' (transformers, in-process)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    template = load_chat_template(str(tok_dir))
    texts = [template.render(chat(q, "ok")) for q in QUESTIONS]
    batch = torch.tensor([tok.encode(t, add_special_tokens=False).ids for t in texts])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    return model.eval()


def write_checkpoint(
    step: Path, state: dict, hf_config: dict, init_from: str, tokenizer: str, keep_source=True
):
    """A step directory as the Checkpointer writes it: DCP {"model": ...}, the run's
    config.json, tokenizer.json (the loaded tokenizer's to_str()), the tokenizer's side files,
    the source's HF configs (keep_source=False: as checkpoints before 2026-12-06, without),
    checksums.json."""
    import torch.distributed.checkpoint as dcp
    from tokenizers import Tokenizer

    step.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {k: v.detach().clone() for k, v in state.items()}
        dcp.save({"model": state}, checkpoint_id=str(step), no_dist=True)
    job = JobConfig(recipe="test")
    job.model = model_config_from_hf(hf_config)
    job.checkpoint.init_from, job.data.tokenizer = init_from, tokenizer
    (step / layout.CONFIG).write_text(json.dumps(job.to_dict(), indent=2))
    tok_json = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    tok_text = Tokenizer.from_file(str(tok_json)).to_str()
    (step / layout.TOKENIZER).write_text(tok_text)
    side = tokenizer_side_files(tokenizer)
    if keep_source:
        side |= source_files(init_from, job.model, tok_text)
    for name, text in side.items():
        (step / name).write_text(text)
    integrity.write(step, integrity.describe(step, integrity.checkpoint_files(step)))
    return step


def export(step: Path, out: Path, capsys, which: str = "export_checkpoint") -> str:
    capsys.readouterr()
    assert tool(which).main([str(step), str(out), "--no-progress"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def written_ids(out: Path) -> tuple[dict, dict]:
    """(config.json's token ids, generation_config.json or {}), as on disk."""
    config = json.loads((out / "config.json").read_text())
    gen = out / "generation_config.json"
    generation = json.loads(gen.read_text()) if gen.is_file() else {}
    return {k: config.get(k, "absent") for k in TOKEN_KEYS}, generation


def greedy_both_ways(out: Path, question: str, capsys) -> tuple[list[int], list[int]]:
    """New ids of tools/generate.py --chat and of transformers' generate (the export's own
    generation config, nothing overridden) on the same question, greedy."""
    capsys.readouterr()
    args = [str(out), "--chat", question, "--max-new-tokens", str(MAX_NEW), "--json"]
    assert tool("generate").main(args) == 0
    ours = json.loads(capsys.readouterr().out)["ids"]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template(chat(question), tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    return ours, theirs[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(source HF dir, a training checkpoint fine-tuned from it to answer 'ok<|im_end|>')."""
    root = tmp_path_factory.mktemp("tokens")
    src = root / "src"
    model = fine_tune(make_source(src), src)
    hf_config = json.loads((src / "config.json").read_text())
    steps = {
        keep: write_checkpoint(
            root / f"run-{keep}" / "checkpoints" / "step-0000100",
            model.state_dict(),
            hf_config,
            f"hf:{src}",
            str(src),
            keep_source=keep,
        )  # fmt: skip
        for keep in (True, False)
    }
    return src, steps


@pytest.mark.parametrize(
    "source_kept,copy_kept", [(True, True), (False, True), (True, False), (False, False)]
)
def test_finetuned_export_stops_at_end_of_turn_in_transformers(
    finetuned, tmp_path, capsys, source_kept, copy_kept
):
    """The export's config.json and generation_config.json hold the source's ids (read from the
    copy the checkpoint keeps; without one, from the source while it is there, else derived
    from the checkpoint's tokenizer, with the same result); transformers' greedy generate stops
    at <|im_end|> where generate.py does."""
    src, steps = finetuned
    step = steps[copy_kept]
    assert (step / SOURCE_CONFIG).is_file() is copy_kept
    source_gen = json.loads((src / "generation_config.json").read_text())
    if not source_kept:
        moved = tmp_path / "elsewhere"
        shutil.copytree(src, moved)
        shutil.rmtree(src)
    try:
        summary = export(step, tmp_path / "out", capsys)
    finally:
        if not source_kept:
            shutil.copytree(moved, src)
    for question in ("What is 3?", "What is 25?"):
        ours, theirs = greedy_both_ways(tmp_path / "out", question, capsys)
        assert ours[-1] == IM_END and 1 < len(ours) < MAX_NEW, ours  # fine-tuned to stop there
        assert theirs == ours
    config, generation = written_ids(tmp_path / "out")
    assert config == SOURCE_IDS
    assert generation["bos_token_id"] == source_gen["bos_token_id"] == 0
    assert generation["pad_token_id"] == source_gen["pad_token_id"] == 0
    # The source's eos, then generate.py's stops: end-of-turn (already it) and end-of-text.
    assert source_gen["eos_token_id"] == IM_END
    assert generation["eos_token_id"] == [IM_END, END_OF_TEXT]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert [getattr(loaded.config, k) for k in TOKEN_KEYS] == list(SOURCE_IDS.values())
    if copy_kept:
        expected_from = f"from {step / SOURCE_CONFIG}"
    else:
        expected_from = f"from {src / 'config.json'}" if source_kept else "from the checkpoint's"
    assert expected_from in summary, summary
    assert ("not found" in summary) is (not source_kept and not copy_kept), summary


@pytest.mark.parametrize("keep", [False, True])
def test_source_ids_are_kept_through_dcp_checkpoints_even_where_the_tokenizer_differs(
    tmp_path, capsys, keep
):
    """A source whose bos (1, <|im_start|>) is not what its tokenizer implies, converted to DCP,
    trained from (init_from dcp:), and that run's checkpoint trained from again: the export
    of the last keeps the source's ids and generation config, and says where the tokenizer
    disagrees."""
    src = tmp_path / "src"
    model = make_source(src, bos_token_id=1, pad_token_id=None)
    convert_hf_to_dcp(str(src), str(tmp_path / "dcp"), progress=False)
    hf_config = json.loads((src / "config.json").read_text())
    first = write_checkpoint(
        tmp_path / "a" / "step-0000001", model.state_dict(), hf_config,
        f"dcp:{tmp_path / 'dcp'}", str(tmp_path / "dcp"), keep_source=keep,
    )  # fmt: skip
    second = write_checkpoint(
        tmp_path / "b" / "step-0000001", model.state_dict(), hf_config, f"dcp:{first}",
        str(first), keep_source=keep,
    )  # fmt: skip
    if keep:  # the copies alone: neither the conversion nor the first run is needed
        shutil.rmtree(tmp_path / "dcp")
        shutil.rmtree(first)
    summary = export(second, tmp_path / "out", capsys, "convert_dcp_to_hf")
    config, generation = written_ids(tmp_path / "out")
    assert config == {"bos_token_id": 1, "eos_token_id": IM_END, "pad_token_id": None}
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, [IM_END, END_OF_TEXT])
    where = second / SOURCE_CONFIG if keep else tmp_path / "dcp" / "hf_config.json"
    assert f"from {where}" in summary, summary
    assert "implies bos_token_id 0" in summary and "has 1 (kept)" in summary, summary
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.generation_config.eos_token_id == [IM_END, END_OF_TEXT]


def test_a_run_with_another_tokenizer_gets_that_tokenizers_ids(tmp_path, capsys):
    """init_from hf:SRC with --data.tokenizer OTHER: SRC's ids mean nothing to OTHER's
    vocabulary, so the export takes OTHER's (here bos 0 <|endoftext|>, eos 1 <|im_end|>)."""
    src, other = tmp_path / "src", tmp_path / "other"
    model = make_source(src, eos_token_id=7)
    other.mkdir()
    tok = train_bpe(["some other text, tokenized otherwise " * 20], VOCAB - 1)
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(other / "tokenizer.json"))
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    step = write_checkpoint(
        tmp_path / "run" / "step-0000001", model.state_dict(),
        json.loads((src / "config.json").read_text()), f"hf:{src}", str(other),
    )  # fmt: skip
    summary = export(step, tmp_path / "out", capsys)
    config, generation = written_ids(tmp_path / "out")
    im_end = tok.token_to_id("<|im_end|>")
    assert config == {"bos_token_id": 0, "eos_token_id": im_end, "pad_token_id": None}
    assert generation["eos_token_id"] == [im_end, 0]
    assert "another tokenizer" in summary, summary


def test_a_run_from_scratch_exports_its_own_tokenizers_ids(tmp_path, capsys):
    """The project's byte-level BPE (no tokenizer_config.json, no init_from): bos and eos are
    <|endoftext|> (training puts one between documents), pad unknown (null, not Llama's
    default); transformers loads them, into the model's configs and the tokenizer's."""
    src = tmp_path / "src"
    model = make_source(src)
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    tok = train_bpe(["def answer():\n    return 42\n" * 30], VOCAB)
    tok.save(str(bpe / "tokenizer.json"))
    step = write_checkpoint(
        tmp_path / "run" / "step-0000001", model.state_dict(),
        json.loads((src / "config.json").read_text()), "", str(bpe / "tokenizer.json"),
    )  # fmt: skip
    export(step, tmp_path / "out", capsys)
    eot = tok.token_to_id("<|endoftext|>")
    config, generation = written_ids(tmp_path / "out")
    assert config == {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": None}
    assert generation == config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.generation_config.eos_token_id == eot
    assert (loaded.config.bos_token_id, loaded.config.pad_token_id) == (eot, None)
    # Its tokenizer_config.json (it had none): transformers' tokenizer names the same tokens
    # and encodes as tokenizer.json does, adding nothing.
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (eot, eot, None)
    text = "def answer():\n    return 42\n"
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    assert hf_tok.model_max_length == loaded.config.max_position_embeddings


@pytest.mark.slow
def test_recipe_finetune_then_export_stops_like_generate(tmp_path, capsys):
    """The user's report end to end: recipes/llama.py fine-tunes hf:SRC on chat data (one
    process, 30 steps), SRC is deleted, tools/export_checkpoint.py and
    tools/convert_dcp_to_hf.py export the checkpoint,
    transformers' greedy generate stops at <|im_end|> exactly where generate.py stops."""
    src = tmp_path / "src"
    make_source(src)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": chat(q, "ok")}) + "\n" for q in QUESTIONS))
    proc = subprocess.run(
        [sys.executable, "recipes/llama.py", "--checkpoint.init_from", f"hf:{src}",
         "--data.path", str(data), "--train.steps", "30", "--train.seq_len", "32",
         "--train.global_batch", "8", "--train.lr", "1e-2", "--train.warmup_steps", "2",
         "--data.cache_dir", str(tmp_path / "cache"), "--metrics.progress_bar", "false",
         "--metrics.run_dir", str(tmp_path / "run")],
        cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(src)  # the checkpoint keeps the source's configs: the export needs no source
    summary = export(tmp_path / "run", tmp_path / "out", capsys)
    assert SOURCE_CONFIG in summary and "not found" not in summary, summary
    export(tmp_path / "run" / "checkpoints" / "step-0000030", tmp_path / "hf", capsys,
           "convert_dcp_to_hf")  # fmt: skip
    for question in ("What is 3?", "What is 12?"):
        ours, theirs = greedy_both_ways(tmp_path / "out", question, capsys)
        assert ours[-1] == IM_END and 1 < len(ours) < MAX_NEW, ours
        assert theirs == ours
    config, generation = written_ids(tmp_path / "out")
    assert config == SOURCE_IDS
    assert generation.get("eos_token_id") == [IM_END, END_OF_TEXT]
    assert written_ids(tmp_path / "hf") == (config, generation)


def test_a_source_folder_that_holds_no_checkpoint_any_more_is_a_reason_not_an_error(tmp_path):
    """init_from dcp: resolves a run dir to its latest checkpoint; a folder a checkpoint's history
    names that holds none now is why no source config is found (an error raised on rank 0
    alone, building the Checkpointer, would leave the other ranks waiting)."""
    from hybrid2d.checkpoint.hf_tokens import resolve_source
    from hybrid2d.config import ModelConfig

    (tmp_path / "gone").mkdir()
    source, why = resolve_source(f"dcp:{tmp_path / 'gone'}", ModelConfig(), None)
    assert source is None and "is not a checkpoint directory" in why, why
