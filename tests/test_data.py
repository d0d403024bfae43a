"""The data package: corpus reading, tokenizer, token cache, packing and the dp-sharded loader.

References are plain slices of the token stream and a single-process view of the global batch
(`global_batch_at`), so the dp-sharded path is checked against something it does not compute.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import (
    GlobalBatchLoader,
    PackedDataset,
    build_data,
    corpus_documents,
    default_corpus_files,
    eos_id,
    load_or_train_tokenizer,
    tokenize_corpus,
)
from hybrid2d.data import tokenizer as tokenizer_mod
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line

SMALL = 200_000
VOCAB = 512


def loader_of(ds, global_batch: int, dp_rank: int, dp: int, micro_batch: int, seed: int):
    """The loader of dp rank `dp_rank` of `dp` for a global batch split as the layout splits it."""
    cfg = JobConfig()
    cfg.train.global_batch, cfg.train.micro_batch = global_batch, micro_batch
    return GlobalBatchLoader(ds, RunLayout.build(cfg, dp, dp_shard=dp, tp=1), dp_rank, seed)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One small BPE trained on the built-in corpus, shared by the tokenizer tests."""
    cache = tmp_path_factory.mktemp("cache")
    cfg = DataConfig(max_chars=SMALL)
    return cfg, cache, load_or_train_tokenizer(cfg, VOCAB, cache)


# ---- corpus ------------------------------------------------------------------------------------


def test_default_corpus_is_stdlib_without_tests():
    files = default_corpus_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert files == default_corpus_files()
    for r in rel:
        parts = r.split("/")
        assert r.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), r
    assert "os.py" in rel and "json/decoder.py" in rel


def test_corpus_documents_respects_max_chars():
    docs = list(corpus_documents(DataConfig(max_chars=50_000)))
    assert sum(map(len, docs)) == 50_000
    first = default_corpus_files()[0].read_text(encoding="utf-8")
    assert docs[0] == first[:50_000]
    assert len(list(corpus_documents(DataConfig(max_chars=10)))) == 1


def _write_corpus(d: pathlib.Path) -> dict[str, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    docs = {
        "a.txt": ["first document\nwith two lines ünïcode\n"],
        "b.jsonl": ["json doc one", "json doc two\n"],
        "c.parquet": ["parquet row 1", "parquet row 2", "parquet row 3"],
    }
    (d / "a.txt").write_text(docs["a.txt"][0], encoding="utf-8")
    with open(d / "b.jsonl", "w", encoding="utf-8") as f:
        for t in docs["b.jsonl"]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
        f.write("\n")  # a blank line is not a document
    pq.write_table(pa.table({"text": docs["c.parquet"], "n": [1, 2, 3]}), d / "c.parquet")
    (d / "README.md").write_text("not data")
    return docs


def test_txt_jsonl_parquet(tmp_path):
    docs = _write_corpus(tmp_path / "corpus")
    for name, expected in docs.items():
        got = list(corpus_documents(DataConfig(path=str(tmp_path / "corpus" / name))))
        assert got == expected, name
    every = list(corpus_documents(DataConfig(path=str(tmp_path / "corpus"))))
    assert every == docs["a.txt"] + docs["b.jsonl"] + docs["c.parquet"]


def test_bad_corpus_inputs(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError) as e:
        corpus_documents(DataConfig(path=missing))
    one_line(e, "data.path", missing, ".jsonl")

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        corpus_documents(DataConfig(path=str(tmp_path / "empty")))
    one_line(e, "data.path", "empty", "directory")

    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError) as e:
        corpus_documents(DataConfig(path=str(tmp_path / "data.csv")))
    one_line(e, "data.path", "data.csv", ".csv", ".parquet")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ConfigError) as e:
        list(corpus_documents(DataConfig(path=str(bad))))
    one_line(e, "data.text_field", "'text'", ":2", "content")

    _write_corpus(tmp_path / "pq")
    with pytest.raises(ConfigError) as e:
        list(
            corpus_documents(DataConfig(path=str(tmp_path / "pq" / "c.parquet"), text_field="body"))
        )
    one_line(e, "data.text_field", "'body'", "columns")

    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "x.txt").write_text("")
    with pytest.raises(ConfigError) as e:
        list(corpus_documents(DataConfig(path=str(tmp_path / "blank"))))
    one_line(e, "data.path", "no non-empty documents")


# ---- tokenizer ---------------------------------------------------------------------------------


def test_trained_tokenizer_size_roundtrip_and_eos(trained):
    cfg, cache, tok = trained
    assert tok.get_vocab_size() == VOCAB
    assert eos_id(tok) == tok.token_to_id("<|endoftext|>")
    # Text the tokenizer never saw (outside the first SMALL chars) and non-ASCII text.
    text = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:5000]
    for sample in (text, "  héllo wörld ✓\n\tdef f(x):\n        return x  # 日本\n"):
        assert tok.decode(tok.encode(sample).ids) == sample


def test_tokenizer_is_cached(trained, monkeypatch):
    cfg, cache, tok = trained
    paths = list(cache.rglob("tokenizer.json"))
    assert len(paths) == 1
    mtime = paths[0].stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("trained again instead of loading the cache")

    monkeypatch.setattr(tokenizer_mod, "train_bpe", no_training)
    again = load_or_train_tokenizer(cfg, VOCAB, cache)
    assert again.get_vocab() == tok.get_vocab()
    assert again.to_str() == tok.to_str()
    assert paths[0].stat().st_mtime_ns == mtime
    # A cached file is a valid data.tokenizer, both as a file and as a (HF-style) directory.
    for setting in (paths[0], paths[0].parent):
        user = load_or_train_tokenizer(DataConfig(tokenizer=str(setting)), VOCAB, cache)
        assert user.get_vocab() == tok.get_vocab()


def test_tokenizer_bigger_than_model_vocab_raises(trained, tmp_path):
    cfg, cache, tok = trained
    path = next(cache.rglob("tokenizer.json"))
    with pytest.raises(ConfigError) as e:
        load_or_train_tokenizer(DataConfig(tokenizer=str(path)), 300, tmp_path)
    one_line(e, "data.tokenizer", f"has {VOCAB} tokens but model.vocab_size is 300")
    with pytest.raises(ConfigError) as e:
        load_or_train_tokenizer(DataConfig(tokenizer=str(tmp_path / "none")), VOCAB, tmp_path)
    one_line(e, "data.tokenizer", "does not exist")


def test_eos_id_missing_raises():
    tok = Tokenizer(models.BPE())
    tok.add_tokens(["a", "b"])
    with pytest.raises(ConfigError) as e:
        eos_id(tok)
    one_line(e, "data.tokenizer", "<|endoftext|>")
    tok.add_special_tokens(["</s>"])
    assert eos_id(tok) == tok.token_to_id("</s>")


# ---- token cache -------------------------------------------------------------------------------


def test_tokenize_corpus_eos_between_documents_and_cache(trained, tmp_path):
    _, _, tok = trained
    corpus = tmp_path / "docs"
    corpus.mkdir()
    docs = [
        "def f():\n    return 1\n",
        "class A:\n    pass\n",
        "x = '<|endoftext|>'  # the literal text is not a boundary\n",
    ]
    for i, d in enumerate(docs):
        (corpus / f"{i}.txt").write_text(d)
    cfg = DataConfig(path=str(corpus))
    cache = tmp_path / "cache"
    tokens = tokenize_corpus(cfg, tok, cache)
    eos = eos_id(tok)
    expected = []
    for d in docs[:2]:
        expected += tok.encode(d, add_special_tokens=False).ids + [eos]
    assert tokens.dtype == np.uint16
    assert tokens[: len(expected)].tolist() == expected
    assert tokens[-1] == eos
    assert int((tokens == eos).sum()) == len(docs)
    # Split at EOS, the stream decodes back to the documents.
    bounds = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], bounds[:-1] + 1])
    assert [tok.decode(tokens[s:b].tolist()) for s, b in zip(starts, bounds, strict=True)] == docs

    again = tokenize_corpus(cfg, tok, cache)
    assert isinstance(again, np.memmap)
    assert np.array_equal(again, tokens)
    assert len(list(cache.rglob("*.npy"))) == 1
    assert not list(cache.rglob("*.tmp"))


# ---- packing -----------------------------------------------------------------------------------


def test_packing_shifts_by_one():
    tokens = np.arange(103, dtype=np.uint16)
    ds = PackedDataset(tokens, seq_len=10)
    assert len(ds) == (103 - 1) // 10
    for i in range(len(ds)):
        inputs, labels = ds[i]
        window = torch.from_numpy(tokens[i * 10 : i * 10 + 11].astype(np.int64))
        assert inputs.dtype == torch.long and inputs.shape == (10,)
        assert torch.equal(inputs, window[:-1])
        assert torch.equal(labels, window[1:])
        assert torch.equal(labels[:-1], inputs[1:])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ConfigError) as e:
        PackedDataset(np.arange(10, dtype=np.uint16), seq_len=10, source="tiny.txt")
    one_line(e, "data.path", "tiny.txt", "holds 10 tokens", "train.seq_len+1=11")


# ---- loader ------------------------------------------------------------------------------------


def _dataset(n_samples=37, seq_len=4):
    return PackedDataset(np.arange(n_samples * seq_len + 1, dtype=np.uint32), seq_len)


def _local(loader):
    """This rank's whole local batch, re-joined from its micro batches."""
    micro = loader.next_batch()
    return torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_union_of_ranks_is_the_global_batch(dp_size):
    ds, gb, seed = _dataset(), 8, 3
    loaders = [loader_of(ds, gb, r, dp_size, 0, seed) for r in range(dp_size)]
    ref = loader_of(ds, gb, 0, 1, 0, seed)
    for step in range(12):  # 96 samples over 37 per epoch: crosses two epoch boundaries
        parts = [_local(ld) for ld in loaders]
        inputs, labels, *_ = ref.global_batch_at(step * gb)
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), labels)
        assert all(
            ld.state_dict()
            == {"samples_consumed": (step + 1) * gb, "seed": seed, "shuffle_block": 0}
            for ld in loaders
        )


def test_micro_batches_split_the_local_slice():
    ds = _dataset()
    whole = loader_of(ds, 8, 1, 2, 0, 0)
    split = loader_of(ds, 8, 1, 2, 2, 0)
    for _ in range(3):
        ((full_in, full_lab, *_),) = whole.next_batch()
        micro = split.next_batch()
        assert len(micro) == 2 and all(m[0].shape == (2, 4) for m in micro)
        assert torch.equal(torch.cat([m[0] for m in micro]), full_in)
        assert torch.equal(torch.cat([m[1] for m in micro]), full_lab)
    with pytest.raises(ConfigError):
        loader_of(ds, 8, 0, 2, 3, 0)
    with pytest.raises(ConfigError):
        loader_of(ds, 6, 0, 4, 0, 0)


@pytest.mark.parametrize("before,after", [(2, 4), (4, 1), (1, 2)])
def test_resume_on_another_dp_size(before, after):
    ds, gb, seed = _dataset(), 8, 5
    first = [loader_of(ds, gb, r, before, 0, seed) for r in range(before)]
    for _ in range(3):
        for ld in first:
            ld.next_batch()
    state = first[0].state_dict()
    resumed = [loader_of(ds, gb, r, after, 0, seed) for r in range(after)]
    for ld in resumed:
        ld.load_state_dict(state)
    straight = loader_of(ds, gb, 0, 1, 0, seed)
    for _ in range(3):
        straight.next_batch()
    for _ in range(4):
        parts = [_local(ld) for ld in resumed]
        ((expected_in, expected_lab, *_),) = straight.next_batch()
        assert torch.equal(torch.cat([p[0] for p in parts]), expected_in)
        assert torch.equal(torch.cat([p[1] for p in parts]), expected_lab)
    with pytest.raises(ConfigError) as e:
        loader_of(ds, gb, 0, 1, 0, seed + 1).load_state_dict(state)
    one_line(e, "train.seed")


def test_epochs_wrap_deterministically():
    ds, gb, seed = _dataset(n_samples=10), 4, 7
    loader = loader_of(ds, gb, 0, 1, 0, seed)
    seen = torch.cat([_local(loader)[0] for _ in range(10)])  # 40 samples = 4 epochs
    first_token = seen[:, 0] // ds.seq_len  # sample index of each row (tokens are arange)
    for epoch in range(4):
        order = first_token[epoch * 10 : (epoch + 1) * 10]
        g = torch.Generator().manual_seed(seed + epoch)
        assert torch.equal(order, torch.randperm(10, generator=g))
    assert not torch.equal(first_token[:10], first_token[10:20])
    again = loader_of(ds, gb, 0, 1, 0, seed)
    assert torch.equal(torch.cat([_local(again)[0] for _ in range(10)]), seen)


# ---- build_data --------------------------------------------------------------------------------


def test_build_data_main_then_ranks(tmp_path):
    cfg = JobConfig()
    cfg.model.vocab_size = VOCAB
    cfg.data.max_chars = SMALL
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.micro_batch = 32, 4, 1
    two = RunLayout.build(cfg, 2)  # dp 2

    calls = []
    with pytest.raises(ConfigError) as e:  # a non-main rank never builds a missing cache
        build_data(cfg, two, 1, False, lambda: calls.append("barrier"))
    one_line(e, "data.cache_dir")
    main, tok = build_data(cfg, two, 0, True, lambda: calls.append("barrier"))
    other, tok1 = build_data(cfg, two, 1, False, lambda: calls.append("barrier"))
    assert calls == ["barrier"] * 3
    assert tok.get_vocab_size() == VOCAB and tok1.to_str() == tok.to_str()
    micro0, micro1 = main.next_batch(), other.next_batch()
    assert len(micro0) == 2 and micro0[0][0].shape == (1, 32)
    inputs, labels, *_ = main.global_batch_at(0)
    assert torch.equal(torch.cat([m[0] for m in micro0 + micro1]), inputs)
    assert int(inputs.max()) < VOCAB
