"""Hugging Face `datasets` as data.path: a save_to_disk directory and an hf: path read with
load_dataset(streaming=True) (hybrid2d/data/hf_datasets.py, paths.py, corpus.py).

The references are readers nobody here wrote against ones that exist already: the same texts
as a .jsonl file (the inline path's own reader) or as .parquet files read by pyarrow; tokens,
the tool's shards, a run's first batches and a streamed run's windows must be theirs, token for
token. The Hub itself is not reachable here: its error is checked in offline mode, and an hf:
path of a local directory goes through the same load_dataset(streaming=True) call.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import build_run_data
from hybrid2d.data.corpus import corpus_documents, corpus_identity, source_files
from hybrid2d.data.shards import open_shards
from hybrid2d.data.tokens import encode_documents, tokenize_corpus
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.paths import HFSource, data_source, hf_source
from tests.checks import one_line
from tests.launch import REPO, launcher_env
from tests.test_shards import VOCAB, make_tokenizer, stdlib_texts, tool, write_jsonl
from tests.test_stream import joined, loaders, run_steps

datasets = pytest.importorskip("datasets")  # the dev extra installs it

SEQ, BATCH = 29, 6


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The same 40-odd documents as: text.jsonl and body.jsonl (the reference), a saved Dataset
    (columns text, body and n, with a null and an empty text, which are no documents), a
    DatasetDict of two splits, and a directory of two .parquet files for hf:/DIR."""
    root = tmp_path_factory.mktemp("hf")
    texts = stdlib_texts(300, 30_000)
    docs = [t[i : i + 25 + i % 1300] for t in texts for i in range(0, len(t), 900)]
    bodies = [d[::-1] for d in docs]
    write_jsonl(root / "text.jsonl", docs)
    write_jsonl(root / "body.jsonl", bodies)
    rows = {"text": docs + [None, ""], "body": bodies + ["", None], "n": list(range(len(docs) + 2))}
    saved = datasets.Dataset.from_dict(rows)
    saved.save_to_disk(str(root / "saved"), max_shard_size="20KB")  # several .arrow shards
    datasets.DatasetDict({"train": saved, "test": saved}).save_to_disk(str(root / "dict"))
    (root / "files" / "data").mkdir(parents=True)
    half = len(docs) // 2
    for i, part in enumerate((slice(0, half), slice(half, None))):
        table = pa.table({"text": docs[part], "n": list(range(len(docs)))[part]})
        pq.write_table(table, root / "files" / "data" / f"train-0000{i}-of-00002.parquet")
    make_tokenizer(root / "tok.json", texts[:5], bos=True)
    assert len(source_files(DataConfig(path=str(root / "saved")))) > 1
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No request leaves the process, in every test here: the Hub is 'unreachable' at once, as
    on a cut-off host, and a local hf:/DIR must be read without it."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def reference_tokens(root, name="text.jsonl"):
    tok = Tokenizer.from_file(str(root / "tok.json"))
    docs = corpus_documents(DataConfig(path=str(root / name)))
    return encode_documents(docs, tok)


def test_the_tool_tokenizes_a_saved_dataset_and_an_hf_dir_as_the_inline_path_does(made, tmp_path):
    tok = str(made / "tok.json")
    for path, field, ref in (
        (made / "saved", "text", reference_tokens(made)),
        (made / "saved", "body", reference_tokens(made, "body.jsonl")),
        (f"hf:{made / 'files'}", "text", reference_tokens(made, "files")),  # read by pyarrow
    ):
        out = tmp_path / f"{field}-{len(str(path))}"
        argv = ["--data.path", str(path), "--data.tokenizer", tok, "--out", str(out),
                "--data.text_field", field, "--workers", "1", "--shard-size", "8KB"]  # fmt: skip
        assert tool().main(argv) == 0
        shards = open_shards(str(out))
        assert shards.num_shards > 2
        assert np.array_equal(np.asarray(shards[0 : len(shards)]), ref), (path, field)
    assert np.array_equal(reference_tokens(made), reference_tokens(made, "files"))


def test_a_missing_or_non_text_column_is_one_line(made, tmp_path, capsys):
    argv = ["--data.path", str(made / "saved"), "--data.tokenizer", str(made / "tok.json"),
            "--out", str(tmp_path / "o"), "--data.text_field", "title"]  # fmt: skip
    assert tool().main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.text_field='title' is not a column of" in err, err
    assert "columns: ['text', 'body', 'n']" in err, err
    for path in (str(made / "saved"), f"hf:{made / 'files'}"):
        with pytest.raises(ConfigError) as e:
            corpus_documents(DataConfig(path=path, text_field="title"))
        one_line(e, "data.text_field='title' is not a column of", "columns: [")
        with pytest.raises(ConfigError) as e:
            corpus_documents(DataConfig(path=path, text_field="n"))
        one_line(e, "data.text_field='n'", "int64", "not text")
    datasets.Dataset.from_dict({"text": ["", None]}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ConfigError) as e:
        list(corpus_documents(DataConfig(path=str(tmp_path / "empty"))))
    one_line(e, "holds no non-empty documents")


def job(root, path, streaming=False) -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.tokenizer = str(path), str(root / "tok.json")
    cfg.data.cache_dir, cfg.data.streaming = str(root / "cache"), streaming
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, SEQ, BATCH
    return cfg


def test_training_reads_a_saved_dataset_as_it_reads_the_same_jsonl(made):
    d = DataConfig(path=str(made / "saved"))
    tok = Tokenizer.from_file(str(made / "tok.json"))
    assert np.array_equal(tokenize_corpus(d, tok, made / "cache"), reference_tokens(made))

    def first_batches(path):
        cfg = job(made, path)
        loader = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None).loader
        return [loader.next_batch()[0].inputs for _ in range(3)]

    want = first_batches(made / "text.jsonl")
    for path in (made / "saved", f"hf:{made / 'files'}"):  # inline, cached like a file's
        assert all(map(torch.equal, first_batches(path), want)), path
    # Held-out data, and a mixture's source, are read the same way.
    cfg = job(made, made / "text.jsonl")
    cfg.data.val_path = f"hf:{made / 'files'}"
    val = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None).val
    assert np.array_equal(val.dataset.tokens, reference_tokens(made))
    cfg = job(made, "")
    cfg.data.mixture = f"a={made / 'saved'}:1,b=hf:{made / 'files'}@train:2"
    loader = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None).loader
    assert len(loader.datasets) == 2
    for source in loader.datasets:
        assert np.array_equal(source.tokens, reference_tokens(made))


def test_streaming_reads_a_saved_dataset_and_an_hf_dir_as_the_inline_stream(made):
    """Streamed from either, the global batches are the inline .jsonl run's (the one order of
    data.shuffle_block; blocks of 5 windows, so several blocks and a short last one), into the
    second epoch (the reader opens the data again)."""
    inline = job(made, made / "text.jsonl")
    inline.data.shuffle_block = 5
    loader = build_run_data(inline, RunLayout.build(inline, 1), 0, True, lambda: None).loader
    steps = len(loader.dataset) // BATCH + 2
    assert len(loader.dataset) > 2 * 5  # several blocks
    want = [loader.global_batch_at(s * BATCH).inputs for s in range(steps)]
    for path in (made / "saved", f"hf:{made / 'files'}"):
        cfg = job(made, path, streaming=True)
        cfg.data.shuffle_block = 5
        got = [joined(step) for step in run_steps(loaders(cfg, 2), steps)]
        for s, batch in enumerate(got):
            assert torch.equal(batch, want[s]), (path, s)


def test_the_hf_spelling():
    hub = "hf:HuggingFaceFW/fineweb-edu:sample-10BT@train"
    assert hf_source(hub) == HFSource("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "",
                                      False)  # fmt: skip
    assert hf_source("hf:wikitext:wikitext-2-raw-v1@validation#b08601e") == HFSource(
        "wikitext", "wikitext-2-raw-v1", "validation", "b08601e", False
    )
    assert hf_source("hf:org/name") == HFSource("org/name", "", "train", "", False)
    assert data_source("hf:org/name") is None  # no local path: nothing to check on disk
    for bad in ("hf:", "hf:a/b/c", "hf:org/name@", "hf:org/name:", "hf:org/name#", "hf:a b"):
        with pytest.raises(ConfigError) as e:
            hf_source(bad)
        one_line(e, f"data.path={bad!r} is not hf:NAME[:CONFIG][@SPLIT][#REVISION]")


def test_an_hf_dir_and_its_errors(made, tmp_path):
    files = made / "files"
    assert hf_source(f"hf:{files}@train") == HFSource(str(files), "", "train", "", True)
    cases = {
        f"hf:{tmp_path / 'none'}": f"{tmp_path / 'none'} is not a directory",
        f"hf:{files}#v1": "a local directory has no revision",
        f"hf:{made / 'saved'}": "was written by save_to_disk, which load_dataset does not read",
        str(made / "dict"): "is a DatasetDict of splits ['train', 'test']; point data.path at "
        f"the split to read, e.g. {made / 'dict' / 'train'}",
    }
    for path, needle in cases.items():
        with pytest.raises(ConfigError) as e:
            corpus_documents(DataConfig(path=path))
        one_line(e, f"data.path={path!r}", needle)
    with pytest.raises(ConfigError) as e:  # the split is load_dataset's to know
        corpus_documents(DataConfig(path=f"hf:{files}@test"))
    one_line(e, "load_dataset(", "split='test'", "Bad split: test. Available splits: ['train']")
    assert len(list(corpus_documents(DataConfig(path=str(made / "dict" / "train"))))) > 40
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "dataset_dict.json").write_text("{")
    with pytest.raises(ConfigError) as e:
        corpus_documents(DataConfig(path=str(tmp_path / "broken")))
    one_line(e, "dataset_dict.json is not a DatasetDict's index")


def test_the_hub_unreachable_is_one_line_naming_data_path():
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.streaming = "hf:nobody/nothing:sub@train", True
    with pytest.raises(ConfigError) as e:
        corpus_documents(cfg.data)
    one_line(e, "data.path='hf:nobody/nothing:sub@train': the Hugging Face Hub cannot be reached")
    cfg.data.format, cfg.data.streaming = "instruct", False  # refused before anything is read
    with pytest.raises(ConfigError) as e:
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    one_line(e, "data.format=instruct", "read through the datasets package, as text")


def test_the_identity_of_a_dataset(made, tmp_path):
    def ident(path, field="text"):
        return corpus_identity(DataConfig(path=path, text_field=field))

    hub = {ident(p) for p in ("hf:a/b", "hf:a/b:c", "hf:a/b@test", "hf:a/b#v2", "hf:a/c")}
    assert len(hub) == 5 and ident("hf:a/b") == ident("hf:a/b@train")
    assert ident("hf:a/b", "body") != ident("hf:a/b")
    copy = tmp_path / "files"
    (copy / "data").mkdir(parents=True)
    for p in (made / "files" / "data").iterdir():
        (copy / "data" / p.name).write_bytes(p.read_bytes())
    before = ident(f"hf:{copy}")
    (copy / "data" / "train-00002-of-00002.parquet").write_bytes(b"")  # a file more
    assert ident(f"hf:{copy}") != before
    assert ident(str(made / "saved")) != ident(str(made / "dict" / "train"))


def test_without_the_datasets_package_one_line_says_how_to_install_it(made, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails, find_spec finds none
    for path in (str(made / "saved"), "hf:org/name"):
        with pytest.raises(ConfigError) as e:
            source_files(DataConfig(path=path))
        one_line(e, f"data.path={path!r}", "needs the datasets package: pip install datasets")


def test_the_built_in_corpus_is_not_a_dataset_whatever_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "state.json").write_text("{}")  # "" must not read as the working directory
    monkeypatch.chdir(tmp_path)
    cfg = job(tmp_path, "")
    cfg.data.tokenizer, cfg.data.format = "", "instruct"  # an hf source would refuse instruct
    with pytest.raises(ConfigError) as e:
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    one_line(e, "data.format=instruct needs .jsonl files, but data.path holds ['.py']")


def test_the_recipe_refuses_a_bad_hf_path_in_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "llama.py"), "--data.path", "hf:a/b@x/y"],
        capture_output=True, text=True, timeout=120, env=launcher_env(), cwd=tmp_path,
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "data.path='hf:a/b@x/y' is not hf:NAME[:CONFIG][@SPLIT][#REVISION]" in lines[0]
