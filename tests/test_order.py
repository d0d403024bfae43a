"""One order of text windows for every way of reading them (data/order.py, data.shuffle_block).

The reference is the order as specified, written out here with torch alone: epoch e's windows
permuted in consecutive blocks of data.shuffle_block, block b by torch.randperm(size_b) seeded
with seed + e + b * 2**32, and the windows themselves the inline token stream (encode_documents)
cut by PackedDataset. Inline (GlobalBatchLoader over the cached token array), preprocessed
(tools/tokenize_corpus.py's shards) and streamed (StreamingLoader, dp ranks as threads) must
give its first global batches, across an epoch boundary, with document masks off and on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data import build_run_data
from hybrid2d.data.corpus import corpus_documents
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.order import BlockOrder
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.tokens import encode_documents
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line
from tests.reference import tiny_config
from tests.test_checkpoint import one_rank  # noqa: F401 (a fixture)
from tests.test_shards import VOCAB, make_tokenizer, stdlib_texts, tool, write_jsonl
from tests.test_stream import Group, joined, loaders, run_steps

SEQ, BATCH, SEED = 29, 6, 5


def spec_order(n: int, block: int, seed: int, count: int) -> np.ndarray:
    """The first `count` window indices of the specified order, epoch after epoch."""
    out: list[int] = []
    epoch = 0
    while len(out) < count:
        for b, lo in enumerate(range(0, n, block)):
            g = torch.Generator().manual_seed(seed + epoch + b * 2**32)
            out += (lo + torch.randperm(min(block, n - lo), generator=g)).tolist()
        epoch += 1
    return np.array(out[:count])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 60 documents of 30-700 characters as JSONL, a tokenizer with BOS, the corpus
    preprocessed (shards of 4 KB of text: windows cross shard edges), and the block size: a
    few windows, not dividing the corpus's (the last block is short)."""
    root = tmp_path_factory.mktemp("order")
    texts = stdlib_texts(600, 16_000)
    make_tokenizer(root / "tok.json", texts[:4], bos=True)
    docs = [t[i : i + 30 + i % 670] for t in texts for i in range(0, len(t), 300)][:60]
    (root / "c").mkdir()
    write_jsonl(root / "c" / "a.jsonl", docs)
    argv = ["--data.path", str(root / "c"), "--data.tokenizer", str(root / "tok.json"),
            "--out", str(root / "pre"), "--workers", "1", "--shard-size", "4KB"]  # fmt: skip
    assert tool().main(argv) == 0
    tok = Tokenizer.from_file(str(root / "tok.json"))
    tokens = encode_documents(corpus_documents(DataConfig(path=str(root / "c"))), tok)
    n = (len(tokens) - 1) // SEQ
    block = next(b for b in (7, 9, 11, 13) if n % b)
    assert n > 4 * block
    return root, tokens, n, block


def job(root, path, block, document_mask="off", streaming=False) -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.tokenizer = str(path), str(root / "tok.json")
    cfg.data.cache_dir, cfg.data.document_mask = str(root / "cache"), document_mask
    cfg.data.shuffle_block, cfg.data.streaming = block, streaming
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, SEQ, BATCH
    cfg.train.seed = SEED
    return cfg


def cached(cfg, dp: int = 1) -> list:
    layout = RunLayout.build(cfg, dp)
    return [build_run_data(cfg, layout, r, r == 0, lambda: None).loader for r in range(dp)]


def test_block_order_is_the_specified_one_and_a_small_corpus_keeps_the_epoch_permutation():
    order = BlockOrder(23, 5, SEED)  # blocks of 5, 5, 5, 5, 3
    assert np.array_equal(order.indices(0, 80), spec_order(23, 5, SEED, 80))
    assert np.array_equal(order.indices(31, 20), spec_order(23, 5, SEED, 51)[31:])
    for block in (0, 23, 8192):  # the whole epoch: GlobalBatchLoader's order before blocks
        whole = BlockOrder(23, block, SEED).indices(0, 46)
        for e in (0, 1):
            g = torch.Generator().manual_seed(SEED + e)
            assert np.array_equal(whole[23 * e : 23 * (e + 1)], torch.randperm(23, generator=g))


@pytest.mark.parametrize("document_mask", ["off", "on"])
def test_inline_preprocessed_and_streamed_give_the_same_first_batches(corpus, document_mask):
    root, tokens, n, block = corpus
    steps = n // BATCH + 2  # into the second epoch
    eos = Tokenizer.from_file(str(root / "tok.json")).token_to_id("<|endoftext|>")
    ref = PackedDataset(tokens, SEQ, eos=eos if document_mask == "on" else None)
    want = spec_order(n, block, SEED, steps * BATCH)
    inline = cached(job(root, root / "c", block, document_mask))[0]
    pre = cached(job(root, root / "pre", block, document_mask), dp=2)
    streamed = loaders(job(root, root / "c", block, document_mask, streaming=True), 3)
    got_streamed = run_steps(streamed, steps)
    for s in range(steps):
        expected = ref.gather(want[s * BATCH : (s + 1) * BATCH])
        pre_step = [m for ld in pre for m in ld.next_batch()]
        for field in ("inputs", "labels", "documents"):
            a = getattr(expected, field)
            for got in (inline.global_batch_at(s * BATCH), got_streamed[s], pre_step):
                if isinstance(got, list):  # micro batches of the ranks, in rank order
                    parts = [getattr(m, field) for m in got]
                    got = None if all(p is None for p in parts) else torch.cat(parts)
                else:
                    got = getattr(got, field)
                assert (got is None) if a is None else torch.equal(got, a), (s, field)
    for ld in streamed:
        ld.close()


def test_a_mixture_source_follows_the_same_block_order(corpus):
    """Each source of data.mixture is ordered like data.path (its own seed, seed + 7919 for
    the first source): one source of weight 1 gives its windows in that block order."""
    root, tokens, n, block = corpus
    cfg = job(root, "", block)
    cfg.data.mixture = f"a={root / 'c'}:1"
    loader = cached(cfg)[0]
    ref = PackedDataset(tokens, SEQ)
    want = spec_order(n, block, SEED + 7919, 3 * BATCH)
    for s in range(3):
        got = torch.cat([m.inputs for m in loader.next_batch()])
        assert torch.equal(got, ref.gather(want[s * BATCH : (s + 1) * BATCH]).inputs), s
    assert loader.state_dict()["shuffle_block"] == block


def test_a_streamed_resume_mid_block_on_another_dp_size_continues_the_straight_run(corpus):
    root, _, n, block = corpus
    cfg = job(root, root / "c", block, streaming=True)
    steps = n // BATCH + 2
    straight = run_steps(loaders(cfg, 1, round_docs=64), steps)
    three = loaders(cfg, 3)
    first = run_steps(three, 3)  # 18 windows: in block 2, 18 - 2 * block of it served
    state = three[1].state_dict()
    assert state["stream"]["block"] == 18 // block and state["stream"]["served"] == 18 % block
    assert state["stream"]["served"] > 0 and state == three[0].state_dict()
    two = loaders(cfg, 2, round_docs=2)
    for ld in two:
        ld.load_state_dict(state)
    rest = run_steps(two, steps - 3)  # across the epoch's end
    for a, b in zip(first + rest, straight, strict=True):
        assert torch.equal(joined(a), joined(b))
    for ld in three + two:
        ld.close()


def test_every_rank_of_a_2x2_mesh_reads_and_the_stream_does_not_change(corpus):
    """Reading split over the world (dp 2 x tp 2: four readers, ranks r and r+1 one dp rank's
    tp peers) gives the straight dp-1 run's batches, each tp peer the same rows, and a resume
    on dp 3 x tp 1 from its state continues them."""
    root, _, n, block = corpus
    cfg = job(root, root / "c", block, streaming=True)
    steps = n // BATCH + 2
    straight = run_steps(loaders(cfg, 1, round_docs=64), steps)

    def world(dp: int, tp: int) -> list:
        layout, group = RunLayout.build(cfg, dp), Group(dp * tp)
        out = []
        for r in range(dp * tp):
            gather = group.member(r)
            data = build_run_data(cfg, layout, r // tp, False, lambda: None, gather, (r, dp * tp))
            data.loader.round_docs = 2
            out.append(data.loader)
        return out

    four = world(2, 2)
    assert four[0].readers == 4 and four[3].reader == 3
    got = run_steps(four, 5)
    per_rank = len(got[0]) // 4  # micro batches of one rank in a step
    for a, b in zip(got, straight[:5], strict=True):
        ranks = [a[i * per_rank : (i + 1) * per_rank] for i in range(4)]
        assert torch.equal(joined(ranks[0]), joined(ranks[1]))  # tp peers: the same rows
        assert torch.equal(joined(ranks[2]), joined(ranks[3]))
        assert torch.equal(joined(ranks[0] + ranks[2]), joined(b))
    three = world(3, 1)
    for ld in three:
        ld.load_state_dict(four[2].state_dict())
    rest = run_steps(three, steps - 5)
    assert all(torch.equal(joined(a), joined(b)) for a, b in zip(rest, straight[5:], strict=True))
    for ld in four + three:
        ld.close()


def test_a_resume_with_another_block_or_from_before_blocks_is_one_line(corpus):
    root, _, n, block = corpus
    cfg = job(root, root / "c", block)
    loader = cached(cfg)[0]
    state = loader.state_dict() | {"samples_consumed": 12}
    assert state["shuffle_block"] == block
    other = cached(job(root, root / "c", 0))
    with pytest.raises(ConfigError) as e:
        other[0].load_state_dict(state)
    one_line(e, "data.shuffle_block=0", f"data.shuffle_block={block} over {n} windows",
             f"--data.shuffle_block {block}")  # fmt: skip
    old = {"samples_consumed": 12, "seed": SEED}  # saved before the setting: the whole epoch
    with pytest.raises(ConfigError) as e:
        loader.load_state_dict(old)
    one_line(e, "predates the setting", "--data.shuffle_block 0")
    other[0].load_state_dict(old)  # 0: the same order
    big = GlobalBatchLoader(loader.dataset, RunLayout.build(cfg, 1), 0, SEED, shuffle_block=n)
    big.load_state_dict(old)  # a block of the whole corpus: the same order too
    assert big.samples_consumed == 12

    streamed = loaders(job(root, root / "c", block, streaming=True), 1)[0]
    state = streamed.state_dict()
    streamed.load_state_dict(state)
    for bad, needle in (({**state, "shuffle_block": block + 1}, f"{block + 1}; resume with"),
                        ({**state, "seed": SEED + 1}, "train.seed"),
                        ({k: v for k, v in state.items() if k != "shuffle_block"},
                         "before streaming served windows")):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            streamed.load_state_dict(bad)
        one_line(e, needle)
    streamed.close()


def test_streaming_the_whole_epoch_and_a_negative_block_are_one_line(corpus):
    root, _, _, block = corpus
    cfg = job(root, root / "c", 0, streaming=True)
    with pytest.raises(ConfigError) as e:
        RunLayout.build(cfg, 1)
    one_line(e, "data.shuffle_block=0", "a stream holds one block", "data.streaming at false")
    cfg = job(root, root / "c", -1)
    with pytest.raises(ConfigError) as e:
        RunLayout.build(cfg, 1)
    one_line(e, "data.shuffle_block=-1", ">= 0")


def test_a_checkpoint_from_before_blocks_loads_where_the_order_is_the_same(
    corpus,
    tmp_path,
    one_rank,  # noqa: F811
):
    """Through the Checkpointer: an old checkpoint's data state has no shuffle_block (nor, from
    a stream, the block and window served); it is loaded without them and the loader decides:
    the cached paths load where the corpus fits a block (the same order), a stream says its
    old order is gone, each in one line rather than the Checkpointer's "does not fit"."""
    from hybrid2d.checkpoint import layout
    from hybrid2d.checkpoint.dcp import Checkpointer
    from tests.test_checkpoint import Progress

    root, _, n, block = corpus

    class OldState:  # a loader's state as an older hybrid2d saved it
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

    # What GlobalBatchLoader saved before data.shuffle_block: no such key.
    old = {"trainer": Progress(3, 0.0), "trainer.data": OldState({"samples_consumed": 18,
                                                                    "seed": SEED})}  # fmt: skip
    ck = Checkpointer(tiny_config(steps=10), tmp_path, old)
    ck.save(3)
    ck.close()
    path = layout.latest_in_run(tmp_path)
    old_stream = {  # what StreamingLoader saved before blocks: windows in corpus order
        "trainer": Progress(3, 0.0),
        "trainer.data": OldState({"samples_consumed": 18, "stream": {"epoch": 0, "window": 18,
                                                                    "document": 4, "skip": 9}}),
    }  # fmt: skip
    ck = Checkpointer(tiny_config(steps=10), tmp_path / "stream", old_stream)
    ck.save(3)
    ck.close()
    streamed = loaders(job(root, root / "c", block, streaming=True), 1)[0]
    states = {"trainer": Progress(0, 0.0), "trainer.data": streamed}
    with pytest.raises(ConfigError) as e:  # not "does not fit": the keys it lacks are known
        Checkpointer(tiny_config(steps=10), tmp_path, states).load(
            layout.latest_in_run(tmp_path / "stream")
        )
    one_line(e, "before streaming served windows", "checkpoint.init_from dcp:")
    for shuffle_block, fits in ((n, True), (block, False)):
        loader = cached(job(root, root / "c", shuffle_block))[0]
        states = {"trainer": Progress(0, 0.0), "trainer.data": loader}
        if fits:
            assert Checkpointer(tiny_config(steps=10), tmp_path, states).load(path) == 3
            assert loader.samples_consumed == 18
        else:
            with pytest.raises(ConfigError) as e:
                Checkpointer(tiny_config(steps=10), tmp_path, states).load(path)
            one_line(e, "predates the setting", "--data.shuffle_block 0")
