"""Preprocessed corpora (tools/tokenize_corpus.py, data/shards.py, data/preprocess.py).

The reference is the inline path (data/tokens.py, the trainer's own tokenization of data.path):
the shards in order must be its token stream, token for token, and a run's first global batches
(document masks off and on), and a loader resumed from a checkpoint's state, must be the ones
the inline path gives. Bad input is one line each; the tool's memory does not grow with the
corpus and a killed run resumes, keeping the shards it wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import build_run_data, tokens
from hybrid2d.data.corpus import corpus_documents, default_corpus_files
from hybrid2d.data.shards import INDEX, open_shards
from hybrid2d.data.tokens import encode_documents
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line
from tests.launch import REPO, launcher_env

VOCAB = 1024


def tool():
    spec = importlib.util.spec_from_file_location("tc", REPO / "tools" / "tokenize_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stdlib_texts(start: int, chars: int) -> list[str]:
    """Standard-library sources from file `start` on, about `chars` characters of them."""
    out, total = [], 0
    for p in default_corpus_files()[start:]:
        out.append(p.read_text(encoding="utf-8", errors="replace"))
        total += len(out[-1])
        if total >= chars:
            break
    return out


def make_tokenizer(path, texts, bos: bool) -> None:
    """A byte-level BPE with EOS; with `bos`, a post-processor that starts a text with <s>
    (as Llama's does), which each document must then start with."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(path))


def write_jsonl(path, texts) -> None:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A corpus of .jsonl, .txt (spelling <|endoftext|> as text) and .parquet files, a
    tokenizer with BOS, another without, and the corpus preprocessed by the tool (2 workers,
    shards of 40 KB of text: windows cross shard edges)."""
    root = tmp_path_factory.mktemp("shards")
    texts = stdlib_texts(100, 300_000)
    corpus = root / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", texts[: len(texts) // 2])
    (corpus / "b.txt").write_text("text that spells <|endoftext|> and <s> is text\n")
    rows = texts[len(texts) // 2 :] + [None, ""]  # nulls and empty texts are no documents
    pq.write_table(pa.table({"text": rows, "n": list(range(len(rows)))}), corpus / "c.parquet")
    make_tokenizer(root / "tok.json", texts[:8], bos=True)
    make_tokenizer(root / "other.json", texts[:6], bos=False)
    out = root / "pre"
    argv = ["--data.path", str(corpus), "--data.tokenizer", str(root / "tok.json"),
            "--out", str(out), "--workers", "2", "--shard-size", "40KB"]  # fmt: skip
    assert tool().main(argv) == 0
    return root, corpus, out


def job(root, path, document_mask="off") -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.tokenizer = str(path), str(root / "tok.json")
    cfg.data.cache_dir, cfg.data.document_mask = str(root / "cache"), document_mask
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, 37, 6
    return cfg


def test_shards_are_the_inline_token_stream(made):
    root, corpus, out = made
    tok = Tokenizer.from_file(str(root / "tok.json"))
    docs = list(corpus_documents(DataConfig(path=str(corpus))))
    inline = encode_documents(docs, tok)
    shards = open_shards(str(out))
    assert shards.num_shards > 3 and len(shards) == len(inline)
    shards.MAPPED = 2  # reads map and unmap shards as they go
    assert np.array_equal(shards[:], inline)
    assert len(shards._maps) == 2
    # Every document starts with BOS and ends with EOS; the index keeps where each ends.
    ends = np.concatenate([shards.document_ends(i) for i in range(shards.num_shards)])
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("<|endoftext|>")
    assert len(ends) == len(docs) == json.loads((out / INDEX).read_text())["documents"]
    assert np.array_equal(np.flatnonzero(inline == eos) + 1, ends)
    assert (inline[np.concatenate([[0], ends[:-1]])] == bos).all()


@pytest.mark.parametrize("document_mask", ["off", "on"])
def test_first_batches_and_resume_equal_the_inline_path(made, document_mask):
    root, corpus, out = made
    inline_cfg, pre_cfg = job(root, corpus, document_mask), job(root, out, document_mask)
    two = RunLayout.build(pre_cfg, 2)
    inline = build_run_data(inline_cfg, two, 0, True, lambda: None).loader
    pre = [build_run_data(pre_cfg, two, r, r == 0, lambda: None).loader for r in (0, 1)]
    for step in range(5):
        want = inline.global_batch_at(step * 6)
        got = [m for loader in pre for m in loader.next_batch()]
        for field in ("inputs", "labels", "documents"):
            a = getattr(want, field)
            b = [getattr(m, field) for m in got]
            if a is None:
                assert all(x is None for x in b) and document_mask == "off"
            else:
                assert torch.equal(torch.cat(b), a), (step, field)
    # A checkpoint's loader state (after 5 steps on dp 2) resumes on dp 1 at step 6's batch.
    one = build_run_data(pre_cfg, RunLayout.build(pre_cfg, 1), 0, True, lambda: None).loader
    one.load_state_dict(pre[0].state_dict())
    resumed = one.next_batch()
    assert torch.equal(torch.cat([m.inputs for m in resumed]), inline.global_batch_at(30).inputs)


def test_damaged_shards_and_another_tokenizer_are_one_line(made, tmp_path):
    root, _, out = made
    copy = tmp_path / "pre"
    shutil.copytree(out, copy)
    cfg = job(root, copy)

    def build():  # the layout carries data.tokenizer
        return build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)

    cfg.data.tokenizer = str(root / "other.json")
    with pytest.raises(ConfigError) as e:
        build()
    one_line(e, f"data.tokenizer={str(root / 'other.json')!r} is not the tokenizer",
             f"{copy / 'tokenizer.json'}")  # fmt: skip
    cfg.data.tokenizer = str(copy / "tokenizer.json")  # the copy the tool keeps is the same
    build()
    cfg.data.tokenizer = ""
    with pytest.raises(ConfigError) as e:
        build()
    one_line(e, "data.tokenizer is ''", str(copy / "tokenizer.json"))
    cfg.data.tokenizer = str(root / "tok.json")
    shard = copy / "shard-000002.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    with pytest.raises(ConfigError) as e:
        build()
    one_line(e, f"data.path={str(copy)!r}: shard {shard} holds", "truncated")
    shard.unlink()
    with pytest.raises(ConfigError) as e:
        build()
    one_line(e, f"data.path={str(copy)!r}: shard {shard} is missing")
    (copy / INDEX).unlink()
    with pytest.raises(ConfigError) as e:
        build()
    one_line(e, "unfinished tools/tokenize_corpus.py output")


def test_preprocessed_validation_data_and_format_instruct(made):
    """data.val_path may name shards too (its windows are those of the same stream inline);
    data.format=instruct on shards is one line."""
    root, corpus, out = made
    cfg = job(root, corpus)
    cfg.data.val_path = str(out)
    val = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None).val
    inline = build_run_data(job(root, corpus), RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert len(val) == len(inline.loader.dataset)
    assert torch.equal(val.dataset.gather([0, len(val) - 1]).inputs,
                       inline.loader.dataset.gather([0, len(val) - 1]).inputs)  # fmt: skip
    cfg = job(root, out)
    cfg.data.format = "instruct"
    with pytest.raises(ConfigError) as e:
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    one_line(e, f"data.format=instruct, but data.path={str(out)!r} is a preprocessed text corpus")


def test_tool_bad_input_is_one_line_and_exit_2(made, tmp_path, capsys):
    root, corpus, out = made
    tok = str(root / "tok.json")
    tc = tool()

    def error(argv) -> str:
        capsys.readouterr()
        assert tc.main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    line = error(["--data.path", str(corpus / "c.parquet"), "--data.tokenizer", tok,
                  "--data.text_field", "body", "--out", str(tmp_path / "x")])  # fmt: skip
    assert f"data.text_field='body' is not a column of {corpus / 'c.parquet'}" in line
    line = error(["--data.path", str(corpus / "a.jsonl"), "--data.tokenizer", tok,
                  "--shard-size", "40KB", "--out", str(out)])  # fmt: skip
    assert f"--out {out} holds shards of other input (differs in path, sources)" in line
    instruct = tmp_path / "chat.jsonl"
    instruct.write_text(json.dumps({"prompt": "2+2?", "completion": "4"}) + "\n")
    line = error(["--data.path", str(instruct), "--data.tokenizer", tok, "--out",
                  str(tmp_path / "y")])  # fmt: skip
    assert "is instruction data" in line and not (tmp_path / "y").exists()


def test_inline_path_notes_the_tool_above_its_size(made, monkeypatch, capsys):
    root, corpus, _ = made
    cfg = job(root, corpus / "a.jsonl")
    monkeypatch.setattr(tokens, "INLINE_NOTE_BYTES", 1000)
    build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    err = capsys.readouterr().err
    assert err.count("tools/tokenize_corpus.py") == 1, err
    build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)  # cached: said once
    assert "tokenize_corpus" not in capsys.readouterr().err


# ---- the tool as users run it: memory at two corpus sizes, killed and resumed ------------------

SUMMARY = re.compile(
    r"tokenized ([\d,]+) documents into ([\d,]+) tokens in (\d+) shards(?:, (\d+) kept from an "
    r"earlier run)?.* peak RSS main (\d+) MiB, worker (\d+) MiB"
)


def run_tool(args, **kw):
    cmd = [sys.executable, str(REPO / "tools" / "tokenize_corpus.py"), *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)  # fmt: skip


def tool_processes(out) -> list[str]:
    """Processes whose command line names `out` (the tool's main process and its workers)."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:  # ended meanwhile
            pass
    return found


def summary(proc) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    m = SUMMARY.search(out)
    assert m, out
    names = ("documents", "tokens", "shards", "kept", "main_mib", "worker_mib")
    return {k: int((v or "0").replace(",", "")) for k, v in zip(names, m.groups(), strict=True)}


COPIES = 6


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus_and_a_killed_run_resumes(made, tmp_path):
    """1x and COPIES x the same documents, shards of 16 KB: the larger corpus has COPIES x the
    shards and tokens and the same peak RSS, main and worker, within 8 MiB (its token ids held as
    Python ints would be 40 MiB more, as numpy arrays 2 MiB: the bound catches a pipeline that
    keeps what it encoded, not one byte per token). Killed after its first shard, it resumes
    keeping the shards it wrote; its stream is the 1x stream COPIES times."""
    root, _, _ = made
    texts = stdlib_texts(300, 300_000)
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    write_jsonl(small / "part-0.jsonl", texts)
    for i in range(COPIES):
        shutil.copy(small / "part-0.jsonl", large / f"part-{i}.jsonl")
    common = ["--data.tokenizer", root / "tok.json", "--shard-size", "16KB"]
    one = summary(run_tool(["--data.path", small, "--out", tmp_path / "s", "--workers", "2",
                            *common]))  # fmt: skip
    killed = run_tool(["--data.path", large, "--out", tmp_path / "l", "--workers", "1", *common])
    first = tmp_path / "l" / "shard-000000.json"
    while not first.exists() and killed.poll() is None:
        time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)  # the main process only: its workers end themselves
    killed.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while (left := tool_processes(tmp_path / "l")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "workers outlived their killed main process"
    assert not (tmp_path / "l" / INDEX).exists(), "finished before it could be killed"
    written = {p.name: p.stat().st_ino for p in (tmp_path / "l").glob("shard-*.bin")}
    done = {n: i for n, i in written.items() if (tmp_path / "l" / n).with_suffix(".json").exists()}
    big = summary(run_tool(["--data.path", large, "--out", tmp_path / "l", "--workers", "2",
                            *common]))  # fmt: skip
    assert big["kept"] >= len(done) >= 1
    for name, inode in done.items():  # kept, not rewritten
        assert (tmp_path / "l" / name).stat().st_ino == inode
    assert big["tokens"] == COPIES * one["tokens"]
    assert big["shards"] > (COPIES - 1) * one["shards"]
    assert big["main_mib"] <= one["main_mib"] + 8, (one, big)
    assert big["worker_mib"] <= one["worker_mib"] + 8, (one, big)
    small_stream = open_shards(str(tmp_path / "s"))[:]
    assert np.array_equal(open_shards(str(tmp_path / "l"))[:], np.tile(small_stream, COPIES))


@pytest.mark.slow
def test_a_run_on_a_truncated_shard_exits_2_before_its_first_step(made, tmp_path):
    root, _, out = made
    copy = tmp_path / "pre"
    shutil.copytree(out, copy)
    shard = copy / "shard-000001.bin"
    with open(shard, "r+b") as f:
        f.truncate(100)
    cmd = [sys.executable, "recipes/llama.py", "--data.path", str(copy), "--data.tokenizer",
           str(root / "tok.json"), "--model.vocab_size", str(VOCAB), "--metrics.run_dir",
           str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"shard {shard} holds 100 bytes" in lines[0], proc.stderr
    assert "step 1" not in proc.stdout


def test_start_up_stats_each_shard_once(made, tmp_path, monkeypatch):
    """A rank's start-up (checks, the main process's build, the dataset) stats each shard's
    file once: on a shared file system with tens of thousands of shards that is its cost. A
    corpus of 120 tiny shards; os.stat counted per path."""
    from hybrid2d.data.shards import write_index, write_shard

    root, _, out = made
    index = json.loads((out / INDEX).read_text())
    stream = open_shards(str(out))[:6000]
    many = tmp_path / "many"
    many.mkdir()
    shutil.copy(out / "tokenizer.json", many / "tokenizer.json")
    entries = []
    for i, piece in enumerate(np.split(stream, 120)):  # one document of 50 tokens a shard
        entries.append(write_shard(many, i, [(piece, np.array([len(piece)]))], i, 0))
    plan = {k: v for k, v in index.items() if k not in ("format", "tokens", "documents", "shards")}
    write_index(many, plan, entries)
    cfg = job(root, many)
    cfg.data.val_path = str(many)  # validation on the same shards: checked once more, as its own

    stats: dict[str, int] = {}
    real_stat = os.stat

    def counting_stat(path, *args, **kwargs):
        name = os.fspath(path)
        if name.endswith(".bin"):
            stats[name] = stats.get(name, 0) + 1
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting_stat)
    data = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    monkeypatch.undo()
    assert len(data.loader.dataset) > 0
    bins = {str(many / f"shard-{i:06d}.bin") for i in range(120)}
    assert set(stats) == bins
    assert set(stats.values()) == {2}, stats  # data.path's check and data.val_path's
    # Without validation data, one stat each.
    cfg.data.val_path = ""
    stats.clear()
    monkeypatch.setattr(os, "stat", counting_stat)
    build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    monkeypatch.undo()
    assert set(stats) == bins and set(stats.values()) == {1}, stats
