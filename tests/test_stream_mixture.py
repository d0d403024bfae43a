"""A streamed mixture (data.streaming with data.mixture): every text source tokenized on the fly.

The reference is the same mixture read inline (MixtureLoader over each source's cached token
array, tests/test_mixture.py and tests/test_order.py check that one against single-source
loaders and the specified block order): a streamed mixture must give exactly its global
batches, step for step, across the smaller source's epoch end, with document masks off and on,
on 1 to 3 ranks (threads whose all-gather is a barrier, as in tests/test_stream.py), with a
source of preprocessed shards read directly beside streamed ones, and continue them after a
resume on another dp size.
"""

from __future__ import annotations

import pytest
import torch

from hybrid2d.config import JobConfig
from hybrid2d.data import build_run_data
from hybrid2d.data.stream import WindowStream
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line
from tests.reference import tiny_config
from tests.test_checkpoint import one_rank  # noqa: F401 (a fixture)
from tests.test_shards import VOCAB, make_tokenizer, stdlib_texts, tool, write_jsonl
from tests.test_stream import Group, run_steps

SEQ, BATCH, BLOCK, SEED = 23, 6, 5, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL sources of standard-library text (web: about 45 documents; code: 10 short
    ones, so its epoch ends within a few steps), a tokenizer with BOS, and code preprocessed."""
    root = tmp_path_factory.mktemp("streammix")
    texts = stdlib_texts(700, 30_000)
    make_tokenizer(root / "tok.json", texts[:3], bos=True)
    docs = [t[i : i + 40 + i % 500] for t in texts for i in range(0, len(t), 700)]
    (root / "web").mkdir()
    (root / "code").mkdir()
    write_jsonl(root / "web" / "a.jsonl", docs[:45])
    write_jsonl(root / "code" / "a.jsonl", docs[45:55])
    argv = ["--data.path", str(root / "code"), "--data.tokenizer", str(root / "tok.json"),
            "--out", str(root / "code-tok"), "--workers", "1", "--shard-size", "2KB"]  # fmt: skip
    assert tool().main(argv) == 0
    return root


def job(root, streaming: bool, document_mask="off", code="code") -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.mixture = f"web={root / 'web'}:0.6,code={root / code}:0.4"
    cfg.data.tokenizer, cfg.data.cache_dir = str(root / "tok.json"), str(root / "cache")
    cfg.data.streaming, cfg.data.document_mask = streaming, document_mask
    cfg.data.shuffle_block = BLOCK
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, SEQ, BATCH
    cfg.train.seed = SEED
    return cfg


def streamed(cfg, dp: int, round_docs: int = 3) -> list:
    """dp RunData of a streamed mixture, its streams reading `round_docs` documents a round."""
    layout, group = RunLayout.build(cfg, dp), Group(dp)
    out = [build_run_data(cfg, layout, r, r == 0, lambda: None, group.member(r))
           for r in range(dp)]  # fmt: skip
    for data in out:
        for stream in data.loader.streams.values():
            stream.round_docs = round_docs
    return out


def inline(root, document_mask="off"):
    """The same mixture read inline (each source tokenized into the cache): one dp rank."""
    cfg = job(root, False, document_mask)
    return build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)


def fields(step, name):
    parts = [getattr(m, name) for m in step]
    return None if all(p is None for p in parts) else torch.cat(parts)


def assert_same(got: list, want: list, names=("inputs", "labels", "documents")) -> None:
    assert len(got) == len(want)
    for s, (a, b) in enumerate(zip(got, want, strict=True)):
        for name in names:
            x, y = fields(a, name), fields(b, name)
            assert (x is None and y is None) or torch.equal(x, y), (s, name)


@pytest.mark.parametrize(("document_mask", "dp", "code"), [("off", 3, "code"), ("on", 2, "code"),
                                                           ("off", 2, "code-tok")])  # fmt: skip
def test_a_streamed_mixture_gives_the_inline_mixtures_batches(corpus, document_mask, dp, code):
    """Across the code source's epoch end; the last case reads code from its shards."""
    ref = inline(corpus, document_mask)
    code_windows = len(ref.loader.datasets[1])
    steps = code_windows * 2 // (BATCH // 2) + 2  # code, 40% of the rows, past its epoch
    want = run_steps([ref.loader], steps)
    assert ref.loader.taken[1] > code_windows  # its second epoch began
    data = streamed(job(corpus, True, document_mask, code), dp)
    kinds = [isinstance(ds, WindowStream) for ds in data[0].loader.datasets]
    assert kinds == [True, code == "code"]
    got = run_steps([d.loader for d in data], steps)
    assert_same(got, want)
    if document_mask == "on":
        assert fields(got[0], "documents").max() > 0  # documents end inside windows
    # Tokens per source as the inline mixture reports them; the data wait beside them.
    assert data[1].summary()["mixture"] == ref.summary()["mixture"]
    scalars = data[0].scalars()
    assert scalars.pop("perf/data_wait_s") >= 0
    assert scalars == ref.scalars()
    assert data[0].summary()["data_wait_s_total"] >= 0
    assert "web 60% (streamed)" in data[0].describe()
    for d in data:
        d.close()


def test_a_streamed_mixture_resumes_on_another_dp_size_and_inline(corpus):
    """3 steps on dp 3 (mid-block in both sources), then dp 1 and dp 2 from its state give the
    inline run's steps 4 on; the inline mixture continues from the streamed state too (the
    counts alone say its samples), while a stream cannot start from the inline state."""
    ref = inline(corpus)
    want = run_steps([ref.loader], 9)
    three = streamed(job(corpus, True), 3)
    assert_same(run_steps([d.loader for d in three], 3), want[:3])
    state = three[2].loader.state_dict()
    assert state == three[0].loader.state_dict()
    assert {s["served"] for s in state["streams"].values()} != {0}  # mid-block somewhere
    for dp in (1, 2):
        again = streamed(job(corpus, True), dp, round_docs=2)
        for d in again:
            d.loader.load_state_dict(state)
        assert_same(run_steps([d.loader for d in again], 6), want[3:])
        for d in again:
            d.close()
    back = inline(corpus)
    back.loader.load_state_dict({k: v for k, v in state.items() if k != "streams"})
    assert_same(run_steps([back.loader], 6), want[3:])
    one = streamed(job(corpus, True), 1)[0]
    assert set(one.loader.optional_state_keys) >= {"streams.web.served", "streams.code.skip"}
    with pytest.raises(ConfigError) as e:
        one.loader.load_state_dict(ref.loader.state_dict())
    one_line(e, "data.mixture[web] is streamed", "--data.streaming false")
    for d in three:
        d.close()


def test_through_the_checkpointer_a_streamed_state_resumes_streamed_and_inline(
    corpus,
    tmp_path,
    one_rank,  # noqa: F811
):
    """Saved and loaded by the Checkpointer (DCP): a streamed mixture's state continues the
    straight run streamed and inline; an inline mixture's state, which lacks the streams'
    places, is the stream's one line, not the Checkpointer's "does not fit"."""
    from hybrid2d.checkpoint import layout
    from hybrid2d.checkpoint.dcp import Checkpointer
    from tests.test_checkpoint import Progress

    def save(loader, where):
        ck = Checkpointer(tiny_config(steps=10), where, {"trainer": Progress(3, 0.0),
                                                         "trainer.data": loader})  # fmt: skip
        ck.save(3)
        ck.close()
        return layout.latest_in_run(where)

    def load(loader, path):
        states = {"trainer": Progress(0, 0.0), "trainer.data": loader}
        return Checkpointer(tiny_config(steps=10), tmp_path / "load", states).load(path)

    ref = inline(corpus)
    want = run_steps([ref.loader], 6)
    first = streamed(job(corpus, True), 1)[0]
    run_steps([first.loader], 3)
    path = save(first.loader, tmp_path / "streamed")
    for data in (streamed(job(corpus, True), 1)[0], inline(corpus)):
        assert load(data.loader, path) == 3
        assert_same(run_steps([data.loader], 3), want[3:])
        data.close()
    cached = inline(corpus)
    run_steps([cached.loader], 3)
    path = save(cached.loader, tmp_path / "inline")
    later = streamed(job(corpus, True), 1)[0]
    with pytest.raises(ConfigError) as e:
        load(later.loader, path)
    one_line(e, "data.mixture[web] is streamed", "resume with --data.streaming false")
    first.close()


def test_bad_streamed_mixtures_are_one_line(corpus, tmp_path):
    def error(cfg, dp=1) -> str:
        with pytest.raises(ConfigError) as e:
            run_steps([d.loader for d in streamed(cfg, dp)], 1, raises=dp > 1)
        return one_line(e)

    cfg = job(corpus, True)
    cfg.data.val_fraction = 0.1
    assert "data.val_fraction=0.1 is set beside data.mixture" in error(cfg)
    cfg = job(corpus, True)
    cfg.data.tokenizer = ""
    assert "data.tokenizer is ''" in error(cfg)
    (tmp_path / "tiny.txt").write_text("x")  # fewer than seq_len + 1 tokens: at the first step
    cfg = job(corpus, True)
    cfg.data.mixture += f",tiny={tmp_path / 'tiny.txt'}:0.1"
    assert error(cfg, dp=2).startswith(f"data.mixture[tiny]='{tmp_path / 'tiny.txt'}' holds")
    (tmp_path / "i.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = job(corpus, True)
    cfg.data.mixture = f"i={tmp_path / 'i.jsonl'}:1"
    assert "data.mixture[i]=" in error(cfg)
