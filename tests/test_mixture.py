"""Mixtures (data.mixture, data/mixture.py): several text sources, each sample drawn by weight.

References: each source alone, read by the single-source loader (GlobalBatchLoader) with the
source's seed, and numpy's bincount of the drawn sources. The stream is fixed by the seed, the
same on every dp size, and a resume continues with the straight run's samples.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from hybrid2d.data import build_run_data
from hybrid2d.data.loader import GlobalBatchLoader
from hybrid2d.data.mixture import MixtureLoader, parse_mixture
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.checks import one_line
from tests.launch import recipe_error, recipe_run
from tests.test_shards import VOCAB, make_tokenizer, stdlib_texts, tool, write_jsonl


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two preprocessed corpora of other standard-library files (web, code), a .txt tokenized
    inline (notes), a tokenizer, and a corpus preprocessed with another tokenizer."""
    root = tmp_path_factory.mktemp("mixture")
    texts = stdlib_texts(300, 160_000)
    make_tokenizer(root / "tok.json", texts[:6], bos=True)
    make_tokenizer(root / "other.json", texts[:4], bos=False)
    half = len(texts) // 2
    for name, part, tok in (("web", texts[:half], "tok"), ("code", texts[half:], "tok"),
                            ("foreign", texts[half:], "other")):  # fmt: skip
        (root / name).mkdir()
        write_jsonl(root / name / "a.jsonl", part)
        argv = ["--data.path", str(root / name), "--data.tokenizer", str(root / f"{tok}.json"),
                "--out", str(root / f"{name}-tok"), "--workers", "1"]  # fmt: skip
        assert tool().main(argv) == 0
    (root / "notes.txt").write_text("\n".join(stdlib_texts(20, 30_000)))
    return root


MIX = "web={r}/web-tok:0.5,code={r}/code-tok:0.3,notes={r}/notes.txt:0.2"


def job(root, mixture=MIX, seed=0):
    from hybrid2d.config import JobConfig

    cfg = JobConfig(recipe="test")
    cfg.data.mixture, cfg.data.tokenizer = mixture.format(r=root), str(root / "tok.json")
    cfg.data.cache_dir = str(root / "cache")
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = VOCAB, 37, 6
    cfg.train.seed = seed
    return cfg


def loaders(cfg, dp):
    layout = RunLayout.build(cfg, dp)
    return [build_run_data(cfg, layout, r, r == 0, lambda: None) for r in range(dp)]


def steps(dp_loaders, n) -> list[torch.Tensor]:
    """The global inputs of the next n steps, the ranks' rows joined."""
    return [torch.cat([m.inputs for ld in dp_loaders for m in ld.next_batch()]) for _ in range(n)]


def test_realised_proportions_match_the_weights(sources):
    loader = loaders(job(sources), 1)[0].loader
    n = 60_000  # sd of a fraction <= 0.5/sqrt(n) = 0.002: a tolerance of 0.01 is 5 sd
    drawn = np.bincount(loader.choices(0, n), minlength=3) / n
    assert np.allclose(drawn, [0.5, 0.3, 0.2], atol=0.01), drawn
    for _ in range(300):
        loader.next_batch()
    fractions = [v["fraction"] for v in loader.summary().values()]
    assert np.allclose(fractions, [0.5, 0.3, 0.2], atol=0.05), fractions  # 1,800 samples


def test_each_source_gives_its_own_order_and_the_stream_is_the_seeds(sources):
    data = loaders(job(sources), 1)[0]
    loader = data.loader
    got = steps([loader], 40)
    rows = torch.cat(got)
    src = loader.choices(0, len(rows))
    # Source i's rows, in order, are its own stream: a single-source loader of its dataset.
    for i, ds in enumerate(loader.datasets):
        alone = GlobalBatchLoader(ds, RunLayout.build(job(sources), 1), 0, seed=7919 * (i + 1))
        mine = np.flatnonzero(src == i)
        assert len(mine) > 20
        want = ds.gather(alone.sample_indices(0, len(mine))).inputs
        assert torch.equal(rows[torch.from_numpy(mine)], want), data.loader.names[i]
    tokens = data.summary()["mixture"]
    assert {n: v["tokens"] for n, v in tokens.items()} == {
        n: int((src == i).sum()) * 37 for i, n in enumerate(loader.names)
    }
    assert data.scalars() == {f"data/tokens_{n}": float(v["tokens"]) for n, v in tokens.items()}
    again = steps([loaders(job(sources), 1)[0].loader], 40)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    other = steps([loaders(job(sources, seed=1), 1)[0].loader], 40)
    assert not all(torch.equal(a, b) for a, b in zip(got, other, strict=True))


def test_a_resume_on_another_dp_size_continues_the_straight_run(sources):
    cfg = job(sources)
    straight = steps([d.loader for d in loaders(cfg, 1)], 9)
    two = [d.loader for d in loaders(cfg, 2)]
    first = steps(two, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, straight[:4], strict=True))
    one = loaders(cfg, 1)[0].loader
    one.load_state_dict(two[1].state_dict())  # every rank's state is the same
    assert two[0].state_dict() == two[1].state_dict()
    rest = steps([one], 5)
    assert all(torch.equal(a, b) for a, b in zip(rest, straight[4:], strict=True))
    masked = job(sources)
    masked.data.document_mask = "on"  # every source's windows carry their documents
    got = [m for ld in [loaders(masked, 1)[0].loader] for _ in range(9) for m in ld.next_batch()]
    inputs, documents = torch.cat([m.inputs for m in got]), torch.cat([m.documents for m in got])
    assert torch.equal(inputs, torch.cat(straight))
    eos = Tokenizer.from_file(str(sources / "tok.json")).token_to_id("<|endoftext|>")
    ends = (inputs == eos).long()
    assert ends.any() and torch.equal(documents, ends.cumsum(1) - ends)
    at = MixtureLoader(one.sources, one.datasets, RunLayout.build(cfg, 1), 0, cfg.train.seed)
    assert torch.equal(at.global_batch_at(6 * 7).inputs, straight[7])


def test_bad_mixtures_are_one_line(sources, tmp_path):
    r = sources

    def error(mixture, **data) -> str:
        cfg = job(r, mixture)
        for k, v in data.items():
            setattr(cfg.data, k, v)
        with pytest.raises(ConfigError) as e:
            loaders(cfg, 1)
        return one_line(e)

    assert "source 'code' has weight '0'" in error("web={r}/web-tok:1,code={r}/code-tok:0")
    assert "has weight '-1'" in error("web={r}/web-tok:-1")
    assert "is not name=path:weight" in error("web={r}/web-tok")
    assert "names a source twice" in error("a={r}/web-tok:1,a={r}/code-tok:1")
    msg = error("web={r}/web-tok:1,code={r}/nothing:1")
    assert msg.startswith(f"data.mixture[code]='{r}/nothing' does not exist")
    msg = error("web={r}/web-tok:1,code={r}/foreign-tok:1")
    assert "sources were tokenized with different tokenizers" in msg
    assert "data.path='x' is set beside data.mixture" in error(MIX, path="x")
    assert "data.val_fraction=0.1 is set beside" in error(MIX, val_fraction=0.1)
    assert "data.tokenizer is ''" in error(MIX, tokenizer="")
    copy = tmp_path / "code-tok"
    shutil.copytree(r / "code-tok", copy)
    (copy / "shard-000000.bin").unlink()
    assert "data.mixture[code]=" in error(f"web={{r}}/web-tok:1,code={copy}:1")
    assert parse_mixture("a=/x:y:0.25")[0].path == "/x:y"  # the last colon sets the weight


def scalars(run, tag) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted((run / "tensorboard").iterdir()):
        acc = EventAccumulator(str(f))
        acc.Reload()
        out += [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
    return sorted(out)


@pytest.mark.slow
def test_a_run_reports_tokens_per_source_and_resumes_them(sources, tmp_path):
    """One launch stops after step 2, a second resumes it to step 3 through the checkpoint;
    a weight of 0 is one line and exit 2 before the first step."""
    run = tmp_path / "run"
    mix = f"web={sources}/web-tok:0.6,notes={sources}/notes.txt:0.4"

    def settings(mixture: str) -> list[str]:
        return ["--data.mixture", mixture, "--data.tokenizer", str(sources / "tok.json"),
                "--data.cache_dir", str(sources / "cache"), "--model.vocab_size", str(VOCAB),
                "--train.steps", "3"]  # fmt: skip

    recipe_run(run, *settings(mix), "--checkpoint.stop_after", "2")
    out, summary = recipe_run(run, *settings(mix), "--checkpoint.resume", "auto")
    assert "resumed from" in out
    cfg = json.loads((run / "config.json").read_text())
    batch, seq = cfg["train"]["global_batch"], cfg["train"]["seq_len"]
    probe = job(sources, mix.replace(str(sources), "{r}"))
    probe.train.seq_len, probe.train.global_batch = seq, batch
    choices = loaders(probe, 1)[0].loader.choices(0, 3 * batch)
    drawn = np.bincount(choices, minlength=2)
    mixture = summary["data"]["mixture"]
    assert [mixture[n]["tokens"] for n in ("web", "notes")] == list(drawn * seq)
    by_step2 = np.bincount(choices[: 2 * batch], minlength=2)
    for i, name in enumerate(("web", "notes")):  # step 2 from the first launch, 3 the resumed
        got = scalars(run, f"data/tokens_{name}")
        assert got[1:] == [(2, float(by_step2[i] * seq)), (3, float(drawn[i] * seq))], got
    bad = settings(mix.replace(":0.4", ":0"))
    error = recipe_error(*bad, "--metrics.run_dir", str(tmp_path / "bad"))
    assert "source 'notes' has weight '0'" in error, error
