"""Packing of instruction samples (first-fit decreasing into rows, per step from a sample
position) and document masks of text windows, checked against what they must equal: each sample
run alone through the plain model, the padded layout, the stream of samples a padded run sees,
and a resume on another dp size. The multi-rank exactness is tests/test_packing_parity.py's."""

import json

import numpy as np
import pytest
import torch
from bench_packing import longtail_lengths
from bench_packing import main as bench_main

from hybrid2d.config import JobConfig, ModelConfig
from hybrid2d.data import build_run_data
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.packing import PackedDataset
from hybrid2d.data.rows import fill_rows, first_fit_decreasing
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.models.llama import Llama
from tests.workers.hf_chat import make_tokenizer
from tests.workers.packing_parity import synthetic_samples

# ---- first-fit decreasing -------------------------------------------------------------------


def naive_ffd(sizes, capacity) -> list[list[int]]:
    """First-fit decreasing as its definition reads: one item at a time, longest first."""
    rows, room = [], []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # sorted() is stable
        j = next((j for j, r in enumerate(room) if r >= sizes[i]), len(rows))
        if j == len(rows):
            rows.append([])
            room.append(capacity)
        rows[j].append(i)
        room[j] -= sizes[i]
    return rows


@pytest.mark.parametrize("high,count", [(65, 300), (9, 200), (30, 1000), (64, 1)])
def test_first_fit_decreasing_is_the_item_by_item_definition(high, count):
    sizes = np.random.default_rng(high).integers(1, high, count)  # many ties among small sizes
    got = [r.tolist() for r in first_fit_decreasing(sizes, 64)]
    assert got == naive_ffd(sizes.tolist(), 64)
    assert first_fit_decreasing(np.array([], dtype=np.int64), 64) == []


def test_first_fit_decreasing_places_each_item_once_within_capacity():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 65, 300)
    rows = first_fit_decreasing(sizes, 64)
    placed = np.concatenate(rows)
    assert sorted(placed.tolist()) == list(range(300))
    assert all(sizes[r].sum() <= 64 for r in rows)
    # FFD's bound (Dosa 2007) against the trivial lower bound on the optimum
    assert len(rows) <= 11 / 9 * np.ceil(sizes.sum() / 64) + 6 / 9
    # first fit: no item would have fitted into an earlier row when it was placed
    order = {int(i): k for k, i in enumerate(np.argsort(-sizes, kind="stable"))}
    for r, row in enumerate(rows):
        for i in row:
            for earlier in rows[:r]:
                before = [j for j in earlier if order[int(j)] < order[int(i)]]
                assert sizes[before].sum() + sizes[i] > 64
    with pytest.raises(ValueError, match="sizes must lie in"):
        first_fit_decreasing(np.array([65]), 64)


def test_fill_rows_takes_a_prefix_that_fits_and_one_more_would_not():
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 40, 200)
    k, rows = fill_rows(sizes, 64, 8)
    assert len(rows) == 8 and sorted(np.concatenate(rows).tolist()) == list(range(k))
    assert all(sizes[r].sum() <= 64 for r in rows)
    assert len(first_fit_decreasing(sizes[: k + 1], 64)) > 8
    k1, rows1 = fill_rows(np.full(3, 60), 64, 8)  # fewer items than rows: empty rows
    assert k1 == 3 and [len(r) for r in rows1] == [1, 1, 1, 0, 0, 0, 0, 0]


# ---- packed rows of instruction samples -----------------------------------------------------


def test_packed_rows_hold_the_padded_rows_contents_as_documents():
    ds = synthetic_samples(40, seed=2, seq_len=32)
    rows = first_fit_decreasing(ds.sizes(np.arange(40)), 32)
    packed = ds.pack(rows)
    assert packed.inputs.shape == (len(rows), 32) and len(rows) < 20
    assert int(packed.real_tokens.sum()) == int(ds.sizes(np.arange(40)).sum())
    for r, row in enumerate(rows):
        pos = 0
        for d, i in enumerate(row):
            one = ds.gather([i])
            n = int(ds.sizes([i])[0])
            assert torch.equal(packed.inputs[r, pos : pos + n], one.inputs[0, :n])
            assert torch.equal(packed.labels[r, pos : pos + n], one.labels[0, :n])
            assert (packed.documents[r, pos : pos + n] == d).all()
            assert (one.labels[0, n:] == -100).all()
            pos += n
        assert (packed.labels[r, pos:] == -100).all()
        assert (packed.documents[r, pos:] == len(row)).all()  # padding: a document of its own


@pytest.mark.parametrize("layer_types,window", [("", 0), ("SF", 5)])
def test_a_packed_row_gives_each_sample_the_logits_it_has_alone(layer_types, window):
    """Odd shapes (3 heads over 1 kv head, head dim 10, ffn 37), a sliding layer composed with
    the document mask: every position of a packed row equals the sample run alone."""
    cfg = ModelConfig(dim=30, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=37, vocab_size=97)
    cfg.layer_types, cfg.sliding_window = layer_types, window
    model = Llama(cfg)
    model.init_weights(0)
    ds = synthetic_samples(12, seed=3, seq_len=24, vocab=97)
    rows = first_fit_decreasing(ds.sizes(np.arange(12)), 24)
    packed = ds.pack(rows)
    assert max(len(r) for r in rows) >= 3
    with torch.no_grad():
        logits = model(packed.inputs, packed.documents)
        for r, row in enumerate(rows):
            pos = 0
            for i in row:
                n = int(ds.sizes([i])[0])
                alone = model(packed.inputs[r : r + 1, pos : pos + n])[0]
                torch.testing.assert_close(logits[r, pos : pos + n], alone, rtol=1e-5, atol=1e-5)
                pos += n


def _loader(ds, global_batch, dp_rank, dp, micro=1, seed=4):
    cfg = JobConfig()
    cfg.train.global_batch, cfg.train.micro_batch, cfg.train.seq_len = global_batch, micro, 32
    layout = RunLayout.build(cfg, dp, dp_replicate=1, dp_shard=dp, tp=1)
    return GlobalBatchLoader(ds, layout, dp_rank, seed, packed=True)


def _step(loaders):
    """The global rows of one step, re-joined from every rank's micro batches."""
    parts = [b for ld in loaders for b in ld.next_batch()]
    return [torch.cat([getattr(b, f) for b in parts]) for f in ("inputs", "labels", "documents")]


def test_packed_steps_consume_the_sample_stream_in_order_and_split_over_dp():
    ds = synthetic_samples(50, seed=5, seq_len=32)
    one = _loader(ds, 4, 0, 1)
    four = [_loader(ds, 4, r, 4) for r in range(4)]
    two = [_loader(ds, 4, r, 2, micro=2) for r in range(2)]
    seen = []
    for _ in range(12):  # several epochs of 50 samples
        start = one.samples_consumed
        rows, k = one.step_rows(start)
        assert sorted(np.concatenate(rows).tolist()) == sorted(one.sample_indices(start, k))
        seen += one.sample_indices(start, k).tolist()
        expected = one.global_batch_at(start)
        got1, got4, got2 = _step([one]), _step(four), _step(two)
        for field, want in zip(got1, expected[:3], strict=True):
            assert torch.equal(field, want)
        assert all(torch.equal(a, b) for a, b in zip(got1, got4, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got1, got2, strict=True))
        assert four[3].samples_consumed == one.samples_consumed == start + k
    for epoch in range(len(seen) // 50):  # each epoch's samples once, in its permutation
        g = torch.Generator().manual_seed(4 + epoch)
        assert seen[epoch * 50 : (epoch + 1) * 50] == torch.randperm(50, generator=g).tolist()
    assert one.served.samples == len(seen) and one.served.rows == 48


@pytest.mark.parametrize("before,after", [(2, 4), (4, 1)])
def test_a_packed_run_resumes_bit_exact_on_another_dp_size(before, after):
    ds = synthetic_samples(50, seed=6, seq_len=32)
    straight = [_loader(ds, 4, r, before) for r in range(before)]
    for _ in range(3):
        _step(straight)
    state = straight[0].state_dict()
    assert state["samples_consumed"] > 3 * 4  # a position in samples, not rows
    resumed = [_loader(ds, 4, r, after, micro=1) for r in range(after)]
    for ld in resumed:
        ld.load_state_dict(state)
    for _ in range(4):
        a, b = _step(straight), _step(resumed)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- document masks of text windows ---------------------------------------------------------


def test_text_document_mask_splits_windows_at_eos_and_matches_each_document_alone():
    eos = 0
    stream = np.array([5, 6, 0, 7, 8, 9, 0, 3, 0, 4, 4, 6, 2, 0, 9, 9, 1], dtype=np.uint16)
    plain = PackedDataset(stream, 8)
    masked = PackedDataset(stream, 8, eos=eos)
    b0, b1 = plain.gather([0, 1]), masked.gather([0, 1])
    assert b0.documents is None and torch.equal(b0.inputs, b1.inputs)
    assert torch.equal(b0.labels, b1.labels)  # the loss is unchanged: only attention narrows
    assert b1.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 2]]
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=24, vocab_size=11)
    model = Llama(cfg)
    model.init_weights(1)
    with torch.no_grad():
        logits = model(b1.inputs, b1.documents)
        for row in range(2):
            for d in b1.documents[row].unique():
                where = (b1.documents[row] == d).nonzero().flatten()
                alone = model(b1.inputs[row : row + 1, where])[0]
                torch.testing.assert_close(logits[row, where], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(b0.inputs), logits, atol=1e-3)


# ---- settings, figures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok") / "chatml"
    make_tokenizer(str(d))
    return d


def _files(tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i % 7}? ", "completion": f"{i + i % 7}."}) + "\n"
            for i in range(60)
        )
    )
    text = tmp_path / "notes.txt"
    text.write_text("Some plain text to validate on.\n" * 40)
    return sft, text


def _cfg(tmp_path, tok_dir, **data) -> JobConfig:
    cfg = JobConfig(recipe="test")
    cfg.data.tokenizer, cfg.data.cache_dir = str(tok_dir), str(tmp_path / "cache")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = 384, 32, 4
    return cfg


@pytest.mark.parametrize(
    "data,says",
    [
        ({"path": "sft", "val_path": "text"}, ["data.val_path=", "notes.txt' is text data",
                                               "sft.jsonl' is instruction data"]),
        ({"path": "text", "val_path": "sft"}, ["data.val_path=", "sft.jsonl' is instruction",
                                               "notes.txt' is text data"]),
        ({"path": "text", "packing": "padded"}, ["data.packing=padded is for instruction"]),
        ({"path": "sft", "document_mask": "on"}, ["data.document_mask=on is for text data"]),
    ],
)  # fmt: skip
def test_layout_settings_and_mixed_kinds_are_one_line(tmp_path, tok_dir, data, says):
    sft, text = _files(tmp_path)
    named = {"sft": str(sft), "text": str(text)}
    cfg = _cfg(tmp_path, tok_dir, **{k: named.get(v, v) for k, v in data.items()})
    with pytest.raises(ConfigError) as e:
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    msg = str(e.value)
    assert "\n" not in msg and all(s in msg for s in says), msg
    assert not (tmp_path / "cache").exists()  # refused before any tokenizing


def test_the_data_line_and_summary_give_the_packing_figures(tmp_path, tok_dir):
    sft, _ = _files(tmp_path)
    cfg = _cfg(tmp_path, tok_dir, path=str(sft), val_fraction=0.2)
    data = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    line = data.describe()
    assert "samples per row" in line and "packing efficiency" in line, line
    assert "one row each would be" in line and "packed rows from 0.2 of data.path" in line, line
    for _ in range(3):
        data.loader.next_batch()
    packing = data.summary()["packing"]
    assert packing["rows"] == 12 and packing["samples_per_row"] > 1.5
    assert packing["padding_fraction"] + packing["packing_efficiency"] == pytest.approx(1)
    assert packing["padding_fraction"] < data.stats["train"]["padding_fraction"]
    cfg.data.packing = "padded"
    padded = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert padded.summary()["layout"] == "padded" and "packing" not in padded.summary()
    assert "samples per row" not in padded.describe()


def test_text_data_with_document_mask_hands_the_trainer_documents(tmp_path, tok_dir):
    text = tmp_path / "docs.jsonl"  # one document per line
    text.write_text("".join(json.dumps({"text": f"note {i}: " + "ab " * (i % 9)}) + "\n"
                            for i in range(80)))  # fmt: skip
    cfg = _cfg(tmp_path, tok_dir, path=str(text), val_path=str(text), document_mask="on")
    data = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert "document mask on" in data.describe() and data.summary()["document_mask"] == "on"
    (batch,) = data.loader.next_batch()[:1]
    eos = batch.inputs == data.loader.dataset.eos
    assert eos.any() and batch.documents is not None and batch.real_tokens is None
    assert torch.equal(batch.documents, eos.long().cumsum(1) - eos.long())
    (val,) = list(data.val.batches(0, 1, 4))[:1]
    assert val.documents is not None
    cfg.data.document_mask = "off"
    plain = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert plain.loader.next_batch()[0].documents is None


def test_the_long_tail_generator_and_the_mask_benchmark():
    lengths = longtail_lengths(20000, 4096, 300)
    assert 270 <= np.median(lengths) <= 330 and lengths.max() == 4097
    assert (lengths > 1500).mean() > 0.01  # a tail, cut at seq_len + 1
    # each exact option is checked against the dense mask before it is timed
    bench_main("masks --seq-len 64 --median 9 --dim 32 --heads 4 --steps 1 --warmup 0".split())
