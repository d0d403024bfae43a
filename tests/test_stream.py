"""Streaming (data.streaming, data/stream.py): data.path tokenized on the fly per dp rank.

The reference is the inline path's token stream (tokens.encode_documents of the corpus, what
the trainer caches) cut by PackedDataset into its windows, in the inline path's order: with the
default data.shuffle_block, larger than this corpus, each epoch's torch.randperm of all windows
seeded with train.seed + epoch (tests/test_order.py covers several blocks and the other paths).
dp ranks are threads here, their all-gather a barrier over a shared list: the loader's only
collective, which the trainer runs over the dp group.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import build_run_data
from hybrid2d.data.corpus import corpus_documents
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.tokens import encode_documents
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line
from tests.launch import recipe_run
from tests.test_shards import VOCAB, make_tokenizer, stdlib_texts, write_jsonl

SEQ, BATCH = 37, 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    texts = stdlib_texts(400, 40_000)
    make_tokenizer(root / "tok.json", texts[:6], bos=True)
    # 42 documents of 30 to 1,950 characters.
    docs = [t[i : i + 30 + i % 1970] for t in texts for i in range(0, len(t), 1400)]
    (root / "c").mkdir()
    write_jsonl(root / "c" / "a.jsonl", docs[:20])
    (root / "c" / "b.txt").write_text(docs[20])  # a .txt file is one document
    write_jsonl(root / "c" / "c.jsonl", docs[21:])
    return root


def job(root, document_mask="off") -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.tokenizer = str(root / "c"), str(root / "tok.json")
    cfg.data.streaming, cfg.data.document_mask = True, document_mask
    cfg.data.cache_dir = str(root / "cache")
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, SEQ, BATCH
    return cfg


class Group:
    """all_gather over `size` threads: each puts its object, waits for all, reads the list."""

    def __init__(self, size: int):
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def member(self, rank: int):
        def all_gather(obj) -> list:
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return all_gather


def loaders(cfg, dp: int, round_docs: int = 3):
    """dp loaders whose ranks tokenize `round_docs` documents per round (the stream does not
    depend on it; small, so that rounds end at odd places in 42 documents)."""
    layout, group = RunLayout.build(cfg, dp), Group(dp)
    out = [build_run_data(cfg, layout, r, False, lambda: None, group.member(r)).loader
           for r in range(dp)]  # fmt: skip
    for ld in out:
        ld.round_docs = round_docs
    return out


def run_steps(dp_loaders, n: int, raises: bool = False) -> list:
    """n steps on every rank (a thread each): per step, the ranks' micro batches in rank order.
    With `raises`, every rank must have failed: the first one's error is raised."""
    out = [[None] * n for _ in dp_loaders]
    errors = []

    def rank(r):
        try:
            for s in range(n):
                out[r][s] = dp_loaders[r].next_batch()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(dp_loaders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if raises:
        assert len(errors) == len(dp_loaders) and not any(t.is_alive() for t in threads)
        raise errors[0]
    assert not errors, errors
    return [[m for r in range(len(dp_loaders)) for m in out[r][s]] for s in range(n)]


def joined(step, field="inputs") -> torch.Tensor:
    return torch.cat([getattr(m, field) for m in step])


def reference(root, document_mask="off"):
    tok = Tokenizer.from_file(str(root / "tok.json"))
    tokens = encode_documents(corpus_documents(DataConfig(path=str(root / "c"))), tok)
    eos = tok.token_to_id("<|endoftext|>") if document_mask == "on" else None
    return PackedDataset(tokens, SEQ, eos=eos)


@pytest.mark.parametrize("document_mask", ["off", "on"])
def test_windows_are_the_inline_streams_in_its_order_across_epochs_and_dp(corpus, document_mask):
    ref = reference(corpus, document_mask)
    n = len(ref)
    steps = n // BATCH + 3  # into the second epoch
    cfg = job(corpus, document_mask)
    assert n < cfg.data.shuffle_block  # one block: the whole epoch's permutation
    order = np.concatenate(
        [torch.randperm(n, generator=torch.Generator().manual_seed(cfg.train.seed + e)).numpy()
         for e in (0, 1)]
    )  # fmt: skip
    got = run_steps(loaders(cfg, 2), steps)
    for s, step in enumerate(got):
        want = ref.gather(order[s * BATCH : (s + 1) * BATCH])
        assert torch.equal(joined(step), want.inputs), s
        assert torch.equal(joined(step, "labels"), want.labels), s
        if document_mask == "on":
            assert torch.equal(joined(step, "documents"), want.documents), s


def test_a_resume_on_another_dp_size_continues_the_straight_run(corpus):
    cfg = job(corpus)
    straight = run_steps(loaders(cfg, 1, round_docs=64), 8)
    three = loaders(cfg, 3)
    first = run_steps(three, 5)
    assert all(torch.equal(joined(a), joined(b)) for a, b in zip(first, straight[:5], strict=True))
    assert three[0].state_dict() == three[2].state_dict()
    assert max(ld.data_wait_s for ld in three) >= 0
    two = loaders(cfg, 2, round_docs=2)
    for ld in two:
        ld.load_state_dict(three[1].state_dict())
    rest = run_steps(two, 3)
    assert all(torch.equal(joined(a), joined(b)) for a, b in zip(rest, straight[5:], strict=True))
    for ld in three + two:
        ld.close()


def test_bad_streaming_settings_are_one_line(corpus, tmp_path):
    def error(**data) -> str:
        cfg = job(corpus)
        for k, v in data.items():
            setattr(cfg.data, k, v)
        with pytest.raises(ConfigError) as e:
            loaders(cfg, 1)[0].next_batch()
        return one_line(e, "data.streaming=true")

    assert "data.val_path" in error(val_fraction=0.1)
    assert "data.tokenizer is ''" in error(tokenizer="")
    (tmp_path / "i.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    assert "instruction data" in error(path=str(tmp_path / "i.jsonl"))
    (tmp_path / "bad").mkdir()  # a line that is not JSON, found by the reader thread
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    cfg = job(corpus)
    cfg.data.path = str(tmp_path / "bad")
    dp2 = loaders(cfg, 2)
    with pytest.raises(ConfigError) as e:  # on every rank, not a hang of the other
        run_steps(dp2, 1, raises=True)
    one_line(e, "a.jsonl:2")
    cfg.data.path = str(tmp_path / "none.txt")
    with pytest.raises(ConfigError) as e:
        loaders(cfg, 1)
    one_line(e, "none.txt")


def test_streaming_reads_validation_data_as_the_cached_paths_do(corpus, tmp_path):
    """data.val_path beside a stream is tokenized once (or read from shards) and evaluated
    whole: the same rows as a run that caches data.path."""
    val = tmp_path / "val.jsonl"
    val.write_text((corpus / "c" / "a.jsonl").read_text())
    cfg = job(corpus)
    cfg.data.val_path = str(val)
    streamed = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    cfg.data.streaming = False
    cached = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert len(streamed.val) == len(cached.val) > 1
    got = list(streamed.val.batches(0, 1, 2))
    want = list(cached.val.batches(0, 1, 2))
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(got, want, strict=True))
    assert "validation:" in streamed.describe()
    streamed.close()


@pytest.mark.slow
def test_a_streamed_2x2_run_resumes_in_one_process_with_the_straight_runs_losses(corpus, tmp_path):
    """Through the trainer: a streamed run on 2x2 (four reader threads, the world all-gather)
    stopped after step 2 (mid-block: 8 windows in blocks of 5) and resumed in one process
    (dp 1) trains on what a straight one-process run trains on, and that on what a run of the
    cached (inline) path trains on: the same losses at every step (to 1e-5: another mesh sums in
    another order); the summary reports the data wait."""

    def run(ranks, run_dir, *more, streaming="true"):
        tp = ["--parallel.tp", "2"] if ranks > 1 else []
        return recipe_run(
            run_dir, "--data.streaming", streaming, "--data.shuffle_block", "5",
            "--data.path", str(corpus / "c"), "--data.tokenizer", str(corpus / "tok.json"),
            "--data.cache_dir", str(tmp_path / "cache"), "--model.vocab_size", str(VOCAB),
            "--train.seq_len", "64", "--train.global_batch", "4", "--train.steps", "4",
            "--metrics.progress_bar", "false", *tp, *more, ranks=ranks,
        )[1]  # fmt: skip

    straight = run(1, tmp_path / "straight")
    inline = run(1, tmp_path / "inline", streaming="false")
    assert inline["losses"] == straight["losses"]  # one process, the same windows: bitwise
    first = run(4, tmp_path / "split", "--checkpoint.stop_after", "2")
    resumed = run(1, tmp_path / "split", "--checkpoint.resume", "auto")
    assert first["mesh"]["dp_shard"] == 2 and first["mesh"]["tp"] == 2
    assert resumed["first_step"] == 3 and resumed["mesh"]["dp_shard"] == 1
    got = first["losses"] + resumed["losses"]
    assert len(got) == 4
    for g, want in zip(got, straight["losses"], strict=True):
        assert abs(g - want) <= 1e-5 * abs(want), (got, straight["losses"])
    assert first["data"]["data_wait_s_total"] >= 0
