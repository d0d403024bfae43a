"""Runs that pack several documents into a row (instruction data packed, text with
data.document_mask on) are priced with the memory estimate's `documents` term by every caller:
the start-of-run prediction (and so its memory check), tools/memory_report.py and tools/plan.py;
other runs keep the plain causal estimate."""

from __future__ import annotations

import json
from types import SimpleNamespace

import memory_report  # tools/memory_report.py (pyproject: the tests' pythonpath holds tools/)
import plan as plan_tool  # tools/plan.py
import pytest

from hybrid2d import recipes
from hybrid2d.cli import apply_overrides
from hybrid2d.config import JobConfig
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.planner import hardware
from hybrid2d.planner.launch import packed_documents, planned
from hybrid2d.planner.memory import estimate


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    sft, text = root / "sft.jsonl", root / "notes.txt"
    sft.write_text(json.dumps({"prompt": "What is 6 x 7? ", "completion": "42."}) + "\n")
    text.write_text("def answer():\n    return 42\n")
    return SimpleNamespace(sft=sft, text=text, missing=root / "nothing.jsonl")


def job(**data) -> JobConfig:
    cfg = JobConfig(recipe="test")
    for key, value in data.items():
        setattr(cfg.data, key, str(value))
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = 512, 256, 8
    return cfg


def test_which_runs_pack_documents(files):
    assert packed_documents(job(path=files.sft))  # auto: its first line is instruction data
    assert packed_documents(job(path=files.sft, format="instruct"))
    assert not packed_documents(job(path=files.sft, packing="padded"))  # one sample a row
    assert not packed_documents(job(path=files.text))
    assert packed_documents(job(path=files.text, document_mask="on"))
    assert not packed_documents(job())  # the built-in corpus, no document masks
    # The settings alone decide where they can: no file is read for data.format text ...
    assert not packed_documents(job(path=files.missing, format="text"))
    with pytest.raises(ConfigError):  # ... and for auto it is
        packed_documents(job(path=files.missing))


def test_the_start_of_run_prediction_prices_packed_rows(files):
    """`planned` gives the trainer's start line and its memory check (check_planned_memory)."""
    hw = hardware.get("cpu")
    for cfg, documents in ((job(path=files.sft), True), (job(path=files.text), False)):
        layout = RunLayout.build(cfg, 2)
        plan = planned(cfg, SimpleNamespace(layout=layout), hw, 2)
        want = estimate(cfg, layout, 0, hw.target, documents).peak
        assert plan["peak_bytes"] == want
    plain = estimate(cfg, layout, 0, hw.target).peak
    assert estimate(cfg, layout, 0, hw.target, documents=True).peak > plain  # a real term


def test_memory_report_and_plan_price_packed_rows(files, capsys, tmp_path):
    rc = memory_report.main(
        ["--recipe", "llama-debug", "--mesh", "2x1", "--target", "cpu", "--json",
         "--data.path", str(files.sft)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    (entry,) = json.loads(out[out.index("\n[") :])
    cfg = recipes.get("llama-debug")
    apply_overrides(cfg, ["--data.path", str(files.sft)])
    layout = RunLayout.on_mesh(cfg, (1, 2, 1))
    assert entry["estimate"]["peak"] == estimate(cfg, layout, 0, "cpu", documents=True).peak
    assert entry["estimate"]["peak"] > estimate(cfg, layout, 0, "cpu").peak
    listing = tmp_path / "plan.json"
    rc = plan_tool.main(
        ["--recipe", "llama-debug", "--gpus-per-node", "2", "--gpu", "cpu", "--json",
         str(listing), "--set", f"data.path={files.sft}"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    peaks = {
        (c["dp_shard"], c["tp"], c["activation_checkpoint"], c["micro_batch"]): c["peak_gib"]
        for c in json.loads(listing.read_text())
    }
    mesh = RunLayout.on_mesh(cfg, (1, 2, 1))
    key = (2, 1, mesh.activation_checkpoint, mesh.micro_batch)
    assert peaks[key] * 2**30 == pytest.approx(estimate(cfg, mesh, 0, "cpu", True).peak, rel=1e-12)


def test_check_run_prices_a_packed_run_as_its_summary_records_it(tmp_path, capsys):
    """--check-run reads whether the run packed from its summary.json's data record (its data
    files may be gone), not from the files."""
    cfg = recipes.get("llama-debug")
    cfg.data.path = str(tmp_path / "gone.jsonl")  # no longer there
    layout = RunLayout.on_mesh(cfg, (1, 1, 1))
    for data, documents in (({"kind": "instruct", "layout": "packed"}, True),
                            ({"kind": "text", "layout": "windows"}, False)):  # fmt: skip
        run = tmp_path / data["layout"]
        run.mkdir()
        (run / "config.json").write_text(json.dumps(cfg.to_dict()))
        summary = {"mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 1}, "tokens_per_s": 4096.0,
                   "peak_memory_bytes_per_rank": [2**30], "data": data}  # fmt: skip
        (run / "summary.json").write_text(json.dumps(summary))
        out = tmp_path / f"{data['layout']}.json"
        assert plan_tool.main(["--check-run", str(run), "--gpu", "cpu", "--json", str(out)]) == 0
        got = json.loads(out.read_text())["estimated_peak_gib"] * 2**30
        want = estimate(cfg, layout, 0, "cpu", documents).peak
        assert got == pytest.approx(want, rel=1e-12), data
    capsys.readouterr()


@pytest.mark.slow
def test_memory_report_simulates_packed_rows_where_the_estimate_prices_them(files, capsys):
    """--simulate on instruction data: the simulated rank's rows hold several documents (their
    per-row masks and positions), so its peak is the packed estimate's (README: within 0.1%),
    not the plain rows' one (about 2% below on llama-debug)."""
    settings = ["--data.path", str(files.sft), "--train.global_batch", "2"]
    argv = ["--recipe", "llama-debug", "--mesh", "2x1", "--target", "cpu", "--json"]
    assert memory_report.main(argv + ["--simulate"] + settings) == 0
    out = capsys.readouterr().out
    (entry,) = json.loads(out[out.index("\n[") :])
    sim = entry["simulated"]
    assert sim["documents"] and sim["world_size"] == 2
    cfg = recipes.get("llama-debug")
    apply_overrides(cfg, settings)
    layout = RunLayout.on_mesh(cfg, (1, 2, 1))
    packed, plain = (estimate(cfg, layout, 0, "cpu", docs).peak for docs in (True, False))
    assert entry["estimate"]["peak"] == packed
    simulated = sim["memory"]["peak"]
    assert abs(simulated - packed) <= 0.001 * packed, (simulated, packed)
    assert abs(simulated - plain) > 0.01 * plain, (simulated, plain)
