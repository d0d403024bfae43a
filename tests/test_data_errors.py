"""Data errors and figures a user meets first: bytes that are not UTF-8 (instruction and text data,
data.path and data.val_path), an empty validation file, a file mixing text and instruction lines
(each one ConfigError line naming the setting, file and line), and the data figures of a
data.val_fraction run (the training part only, the held-out part under `val`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import build_run_data, corpus_documents
from hybrid2d.data.instruct import build_instruction_arrays
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line
from tests.launch import recipe_error
from tests.workers.hf_chat import make_tokenizer

GOOD = {"prompt": "What is 5 + 31? ", "completion": "5 + 31 = 36."}
BAD_BYTES = b"\xff\xfe"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok") / "chatml"
    make_tokenizer(str(d))
    return d


def bad_utf8_jsonl(path):
    """Line 3 ends in bytes that are not UTF-8 (after the JSON object, as an editor leaves them)."""
    good = json.dumps(GOOD).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + good + BAD_BYTES + b"\n" + good + b"\n")
    return path


def with_layout(cfg: JobConfig) -> tuple[JobConfig, RunLayout]:
    return cfg, RunLayout.build(cfg, 1)


def job(tmp_path, tok_dir, **data) -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.tokenizer, cfg.data.cache_dir = str(tok_dir), str(tmp_path / "cache")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = 384, 16, 4
    return cfg


# ---- bytes that are not UTF-8 ------------------------------------------------------------------


def test_instruction_line_that_is_not_utf8_is_named(tok_dir, tmp_path):
    f = bad_utf8_jsonl(tmp_path / "badutf.jsonl")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    with pytest.raises(ConfigError) as e:  # was UnicodeDecodeError, a traceback
        build_instruction_arrays([f], tok, None, 64)
    offset = len(json.dumps(GOOD))
    one_line(e, f"data.path: {f}:3: is not UTF-8 text", f"byte 0xff at offset {offset}")


@pytest.mark.parametrize("setting", ["path", "val_path"])
def test_not_utf8_instruction_data_through_build_run_data(tok_dir, tmp_path, setting):
    bad = bad_utf8_jsonl(tmp_path / "badutf.jsonl")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    paths = {"path": str(bad)} if setting == "path" else {"path": str(good), "val_path": str(bad)}
    with pytest.raises(ConfigError) as e:
        build_run_data(*with_layout(job(tmp_path, tok_dir, **paths)), 0, True, lambda: None)
    one_line(e, f"data.{setting}: {bad}:3: is not UTF-8 text")


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_text_data_that_is_not_utf8_names_file_and_line(tmp_path, suffix):
    f = tmp_path / f"bad{suffix}"
    if suffix == ".txt":
        f.write_bytes(b"hello\nworld" + BAD_BYTES + b"\nmore\n")
        where, offset = f"{f}:2", 5
    else:
        line = json.dumps({"text": "hello"}).encode()
        f.write_bytes(line + b"\n" + b'{"text": "w' + BAD_BYTES + b'"}\n')
        where, offset = f"{f}:2", 11
    with pytest.raises(ConfigError) as e:
        list(corpus_documents(DataConfig(path=str(f))))
    one_line(e, f"data.path={str(f)!r}: {where} is not UTF-8 text", f"offset {offset}")
    with pytest.raises(ConfigError) as e:  # the validation data's errors name data.val_path
        list(corpus_documents(DataConfig(path=str(f)), "data.val_path"))
    one_line(e, f"data.val_path={str(f)!r}: {where} is not UTF-8 text")


def test_not_utf8_text_val_path_is_named_through_build_run_data(tok_dir, tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("some training text\n" * 50)
    bad = tmp_path / "badutf.txt"
    bad.write_bytes(b"hello\nworld" + BAD_BYTES + b"\n")
    cfg = job(tmp_path, tok_dir, path=str(train), val_path=str(bad))
    with pytest.raises(ConfigError) as e:  # said data.path='...badutf.txt'
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    one_line(e, f"data.val_path={str(bad)!r}: {bad}:2 is not UTF-8 text")


def test_not_utf8_is_one_error_line_and_exit_2(tok_dir, tmp_path):
    bad = bad_utf8_jsonl(tmp_path / "badutf.jsonl")
    error = recipe_error(
        "--data.tokenizer", str(tok_dir), "--model.vocab_size", "384", "--data.path", str(bad),
        "--train.seq_len", "32", "--data.cache_dir", str(tmp_path / "cache"),
        "--metrics.run_dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert error.startswith(f"error: data.path: {bad}:3: is not UTF-8 text"), error


# ---- empty validation file; text and instruction lines in one file -------------------------------


def test_empty_val_path_names_data_val_path(tok_dir, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = job(tmp_path, tok_dir, path=str(good), val_path=str(empty))
    with pytest.raises(ConfigError) as e:  # said data.path='...empty.jsonl'
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    msg = one_line(e, f"data.val_path={str(empty)!r} holds no non-empty documents")
    assert "data.path" not in msg, msg


def test_text_then_instruction_lines_is_a_mixed_format_error(tok_dir, tmp_path):
    f = tmp_path / "textfirst.jsonl"
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    f.write_text(json.dumps({"text": "some text"}) + "\n" + json.dumps(chat) + "\n")
    with pytest.raises(ConfigError) as e:  # said: set data.text_field to the text's key
        build_run_data(*with_layout(job(tmp_path, tok_dir, path=str(f))), 0, True, lambda: None)
    msg = one_line(
        e,
        "mixes formats",
        f"{f}:1 is text",
        f"{f}:2 is instruction data (messages)",
        "separate files",
    )
    assert "set data.text_field" not in msg, msg


def test_instruction_then_text_lines_is_a_mixed_format_error(tok_dir, tmp_path):
    f = tmp_path / "chatfirst.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({"text": "some text"}) + "\n")
    with pytest.raises(ConfigError) as e:  # said only: has neither prompt/completion nor messages
        build_run_data(*with_layout(job(tmp_path, tok_dir, path=str(f))), 0, True, lambda: None)
    mixed = f"while {f}:1 is instruction data: mixed formats"
    one_line(e, f"{f}:2: has neither", mixed, "separate files")


def test_instruction_data_forced_to_text_says_so(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ConfigError) as e:
        list(corpus_documents(DataConfig(path=str(f), format="text")))
    one_line(e, f"{f}:1 is instruction data (completion/prompt)", "data.format=text", "instruct")


def test_a_folder_of_jsonl_and_txt_says_why_auto_read_it_as_text(tok_dir, tmp_path):
    """The .txt file made it text, not the first file (which is instruction data)."""
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    (d / "notes.txt").write_text("some text\n")
    with pytest.raises(ConfigError) as e:  # said: took data.path for text by its first file
        build_run_data(*with_layout(job(tmp_path, tok_dir, path=str(d))), 0, True, lambda: None)
    msg = one_line(e, f"{d / 'a.jsonl'}:1 is instruction data", "all its files are .jsonl")
    assert "by its first file" not in msg, msg


# ---- data figures with data.val_fraction -------------------------------------------------------


def test_val_fraction_figures_describe_the_training_part(tok_dir, tmp_path):
    records = [{"prompt": f"q{i} ", "completion": " a" * (1 + i % 5)} for i in range(38)]
    records.append({"prompt": "why " * 40, "completion": " 42"})  # dropped: no loss token fits
    records.append({"prompt": "Q?", "completion": " the answer" * 20})  # truncated
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = job(tmp_path, tok_dir, path=str(f), val_fraction=0.25)
    data = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    train, val = data.loader.dataset, data.val.dataset.dataset  # the packed rows' samples
    whole = train.dataset
    assert len(train) + len(val) == whole.stats.samples == 39

    def loss_tokens(subset) -> int:
        _, labels, *_ = subset.gather(np.arange(len(subset)))
        return int((labels != -100).sum())

    # Was: the whole file's figures under train (39 samples), and no val entry.
    assert data.stats["train"]["samples"] == len(train)
    assert data.stats["val"]["samples"] == len(val)
    assert data.stats["train"]["loss_tokens"] == loss_tokens(train)
    assert data.stats["val"]["loss_tokens"] == loss_tokens(val)
    assert data.stats["train"]["dropped"] == 1 and data.stats["val"]["dropped"] == 0
    cut = 1 if whole.sample_truncated[val.indices].any() else 0
    assert data.stats["val"]["truncated"] == cut and data.stats["train"]["truncated"] == 1 - cut
    assert data.describe().startswith(f"data: instruct, {len(train)} training samples; "
                                      f"{len(train)} samples, ")  # fmt: skip
    # The whole file's figures are the sum of the parts.
    both = {k: data.stats["train"][k] + data.stats["val"][k] for k in ("samples", "loss_tokens")}
    assert both == {"samples": whole.stats.samples, "loss_tokens": whole.stats.loss_tokens}
