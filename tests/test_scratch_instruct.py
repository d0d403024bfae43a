"""Instruction data without a pretrained tokenizer (no data.tokenizer, no init_from): the
byte-level BPE learns from the samples as the model reads them, has ChatML's turn markers as
special tokens, and its directory holds the chat template, which transformers renders and
encodes the same way; a 2x2 run on prompt/completion and chat lines trains, and its checkpoint
carries the template. Text data from scratch keeps its tokenizer."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import build_run_data, corpus_documents
from hybrid2d.data.chat import (
    SCRATCH_TEMPLATE,
    TURN_END,
    TURN_START,
    ChatTemplate,
    load_chat_template,
)
from hybrid2d.data.tokenizer import EOS_TOKEN, load_or_train_tokenizer
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.launch import check_ok, run_ranks
from tests.workers.hf_chat import write_instruction_data

VOCAB = 512


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rendered(record: dict) -> str:
    """A sample's text as a ChatML model reads it, written out here (not by the trainer)."""
    if "messages" in record:
        return "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in record["messages"]
        )
    return record["prompt"] + record["completion"]


def assert_round_trips(tok: Tokenizer, samples: list[dict]) -> None:
    for record in samples:
        text = rendered(record)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        if "messages" in record:  # each marker is one token, not bytes spelling it
            start, end = tok.token_to_id(TURN_START), tok.token_to_id(TURN_END)
            assert ids.count(start) == ids.count(end) == len(record["messages"])


def scratch_job(tmp_path, path, fmt="auto") -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.cache_dir, cfg.data.format = str(path), str(tmp_path / "cache"), fmt
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, 64, 4
    return cfg


@pytest.mark.parametrize("fmt", ["auto", "instruct"])
def test_instruction_data_trains_a_bpe_of_its_rendered_samples(tmp_path, fmt):
    """It stopped with "is instruction data ... but data.format=auto reads it as text"."""
    data = tmp_path / "sft.jsonl"
    write_instruction_data(str(data), 24, seed=4)  # prompt/completion and messages lines
    cfg = scratch_job(tmp_path, data, fmt)
    run = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    tok = run.tokenizer
    assert run.kind == "instruct" and tok.get_vocab_size() == VOCAB
    assert [tok.token_to_id(t) for t in (EOS_TOKEN, TURN_START, TURN_END)] == [0, 1, 2]
    samples = records(data)
    assert_round_trips(tok, samples)
    # The dataset's samples are those texts (prompt/completion closed by the end of text).
    ds = run.loader.dataset
    assert len(ds) == len(samples)
    for i, record in enumerate(samples):
        lo, hi = int(ds.offsets[i]), int(ds.offsets[i + 1])
        end = "" if "messages" in record else EOS_TOKEN
        want = rendered(record) + end
        got = tok.decode(ds.tokens[lo:hi].tolist(), skip_special_tokens=False)
        assert got == want[: len(got)] and (hi - lo == 65 or got == want), (got, want)
    files = sorted(p.name for p in (tmp_path / "cache" / "tokenizers").glob("*/*"))
    assert files == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    # The cache entry is a tokenizer directory: data.tokenizer takes it, template included.
    again = load_or_train_tokenizer(DataConfig(tokenizer=run.tokenizer_dir), VOCAB, tmp_path)
    assert again.to_str() == tok.to_str()
    chat = next(r for r in samples if "messages" in r)
    assert load_chat_template(run.tokenizer_dir).render(chat["messages"]) == rendered(chat)


def test_transformers_reads_the_trained_directory_as_a_chat_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    data = tmp_path / "sft.jsonl"
    write_instruction_data(str(data), 12, seed=5, kind="messages")
    cfg = scratch_job(tmp_path, data)
    run = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    hf = transformers.AutoTokenizer.from_pretrained(run.tokenizer_dir)
    assert hf.eos_token == TURN_END and hf.pad_token == EOS_TOKEN
    ds = run.loader.dataset
    for i, record in enumerate(records(data)):
        text = hf.apply_chat_template(record["messages"], tokenize=False)
        assert text == rendered(record)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        lo, hi = int(ds.offsets[i]), int(ds.offsets[i + 1])
        assert ds.tokens[lo:hi].tolist() == ids[: hi - lo]


def test_text_data_from_scratch_keeps_its_tokenizer(tmp_path):
    """No chat tokens, no template files: a text run's tokenizer and cache entry as before."""
    data = tmp_path / "notes.txt"
    data.write_text("def answer():\n    return 42  # <|im_start|> is text here\n" * 30)
    cfg = scratch_job(tmp_path, data)
    run = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert run.kind == "text" and run.tokenizer_dir == ""
    assert run.tokenizer.token_to_id(TURN_START) is None
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    assert "chat" not in entry.name and [p.name for p in entry.iterdir()] == ["tokenizer.json"]


def test_the_trained_template_renders_as_chatml():
    conv = [{"role": "user", "content": "6 x 7?"}, {"role": "assistant", "content": "42"}]
    template = ChatTemplate(SCRATCH_TEMPLATE)
    assert template.render(conv) == rendered({"messages": conv})
    assert template.render(conv[:1], add_generation_prompt=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_instruction_data_read_as_text_under_format_instruct_does_not_blame_auto(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": "q ", "completion": "a"}) + "\n")
    with pytest.raises(ConfigError) as e:
        list(corpus_documents(DataConfig(path=str(f), format="instruct")))
    msg = str(e.value)
    assert "\n" not in msg and f"{f}:1 is instruction data" in msg, msg
    assert "data.format=instruct" in msg and "auto" not in msg, msg


@pytest.mark.slow
def test_2x2_trains_on_both_instruction_formats_from_scratch(tmp_path):
    """One 4-rank launch (dp 2 x tp 2) on prompt/completion and chat lines, no tokenizer: the
    loss falls, and the checkpoint's tokenizer (with its template files) round-trips every
    sample."""
    data = tmp_path / "sft.jsonl"
    write_instruction_data(str(data), 48, seed=6)
    run_dir = tmp_path / "run"
    settings = {
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_dim": 96, "model.vocab_size": VOCAB, "train.seq_len": 62,
        "train.global_batch": 8, "train.steps": 10, "train.warmup_steps": 2,
        "parallel.dp_shard": 2, "parallel.tp": 2, "data.path": data,
        "data.cache_dir": tmp_path / "cache", "metrics.run_dir": run_dir,
        "metrics.progress_bar": "false", "metrics.tensorboard": "false",
    }  # fmt: skip
    args = [str(x) for k, v in settings.items() for x in (f"--{k}", v)]
    check_ok(run_ranks(4, ["recipes/llama.py", *args], timeout=400))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data"]["kind"] == "instruct", summary["data"]
    losses = summary["losses"]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    step = run_dir / "checkpoints" / "step-0000010"
    names = {p.name for p in step.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names, names
    assert json.loads((step / "tokenizer_config.json").read_text())["eos_token"] == TURN_END
    assert_round_trips(Tokenizer.from_file(str(step / "tokenizer.json")), records(data))
