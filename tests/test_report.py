"""The memory report's HTML stays readable on large meshes and says what would fit."""

import dataclasses
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from hybrid2d import recipes
from hybrid2d.layout import RunLayout
from hybrid2d.planner.memory import estimate
from hybrid2d.profiling.profiler import load_measured
from hybrid2d.profiling.report import STACKED, Entry, Report, group_identical_ranks, html_page
from tests.launch import REPO


def test_identical_ranks_are_drawn_once_with_their_count():
    same = {"parameters": 10, "activations": 5}
    bars = [(str(r), dict(same)) for r in range(63)] + [("63", {"parameters": 9, "activations": 5})]
    marks = {str(r): 15.0 for r in range(63)} | {"63": 14.0}
    grouped, new_marks = group_identical_ranks(bars, marks)
    assert [label for label, _ in grouped] == ["0-62 (x63)", "63"]
    assert new_marks == {"0-62 (x63)": 15.0, "63": 14.0}
    # Nothing to group: unchanged.
    assert group_identical_ranks(bars[62:], {}) == (bars[62:], {})


def test_html_shows_the_terminal_remedy_and_one_bar_per_kind_of_rank(tmp_path):
    out = tmp_path / "rep"
    args = ["--recipe", "llama3.1-70b", "--mesh", "8x8", "--device-memory", "24GB"]
    proc = subprocess.run(
        [sys.executable, "tools/memory_report.py", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("8x8"))
    remedy = row.split("NO", 1)[1].strip()
    assert "--train.micro_batch" in remedy
    page = (out / "memory_report.html").read_text()
    ET.fromstring(page.split("\n", 1)[1])  # well-formed after the doctype
    fit_table = page.split('class="fit"', 1)[1].split("</table>", 1)[0]
    assert remedy in fit_table
    assert "(x64)" in page  # 64 identical ranks: one bar


def test_a_run_dir_resumed_on_fewer_ranks_reports_only_the_newest_launchs_ranks(tmp_path):
    """2x2 with --profile.memory, then a resume on 1x2: the 4-rank launch's rank2/rank3.json
    stay in memory/, and the report showed four ranks for a 2-rank mesh."""
    (tmp_path / "memory").mkdir()

    def write(rank, world, mesh):
        data = {"rank": rank, "world_size": world, "mesh": mesh, "steps": [{"rank": rank}]}
        (tmp_path / "memory" / f"rank{rank}.json").write_text(json.dumps(data))

    for rank in range(4):
        write(rank, 4, {"dp_replicate": 1, "dp_shard": 2, "tp": 2})
    for rank in range(2):  # the resume rewrites ranks 0 and 1
        write(rank, 2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2})
    assert [r["rank"] for r in load_measured(str(tmp_path))] == [0, 1]


def test_a_mesh_nothing_fits_on_names_the_fewest_gpus_that_fit(tmp_path, capsys):
    """llama3.1-70b on 8 GPUs of 80 GiB fits no mesh at any micro batch or checkpointing: the
    way out is the planner's fewest GPUs on which a mesh fits, checked here against the
    memory estimate of every mesh of 8 GPUs and of the named one."""
    import memory_report  # tools/memory_report.py

    args = ["--recipe", "llama3.1-70b", "--mesh", "8x1", "--mesh", "4x2", "--device-memory"]
    assert memory_report.main([*args, "80GiB", "--out", str(tmp_path)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()[:3] in ("8x1", "4x2")]
    assert len(rows) == 2
    m = re.search(
        r"fewest GPUs that fit: (\d+) \((\d+) nodes of 8\), as mesh (\d+)x(\d+)x(\d+) "
        r"\(dp_replicate x dp_shard x tp\) with (\w+) activation checkpointing and micro batch "
        r"(\d+): ([\d.]+) GiB per rank",
        rows[0],
    )
    assert m and m.group(0) in rows[1], rows
    gpus, nodes, rep, shard, tp = map(int, m.groups()[:5])
    ac, micro, peak = m[6], int(m[7]), float(m[8])
    assert gpus == rep * shard * tp == 8 * nodes and tp <= 8

    cfg = recipes.get("llama3.1-70b")
    usable = 80 * 2**30 * 0.9
    named = dataclasses.replace(
        RunLayout.on_mesh(cfg, (rep, shard, tp)), activation_checkpoint=ac, micro_batch=micro
    )
    assert estimate(cfg, named, 0, "cuda").peak == pytest.approx(peak * 2**30, rel=1e-3)
    assert peak * 2**30 <= usable
    for tp8 in (1, 2, 4, 8):  # nothing of 8 GPUs fits: full checkpointing, micro batch 1
        small = RunLayout.on_mesh(cfg, (1, 8 // tp8, tp8))
        small = dataclasses.replace(small, activation_checkpoint="full", micro_batch=1)
        assert estimate(cfg, small, 0, "cuda").peak > usable
    fit_table = (tmp_path / "memory_report.html").read_text().split('class="fit"')[1]
    assert m.group(0) in fit_table.split("</table>")[0]


def _x_of(svg: str, pattern: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, svg)]


def test_bar_charts_draw_the_usable_device_memory():
    """With a device memory every bar chart has a dashed line at memory x (1 - headroom), at
    the x (or height) a bar of that many bytes would reach; without one, none."""
    est = {
        k: v * 2**30
        for k, v in dict(
            parameters=10, gradients=10, optimizer=20, activations=30, communication=5, peak=60
        ).items()
    }
    est |= {"rank": 0, "peak_phase": "loss", "phases": {"loss": {c: est[c] for c in STACKED}},
            "micro_batch": 1, "micro_batches": 1, "seq_len": 8}  # fmt: skip
    entry = Entry("1x2", est, [est], device_memory=80 * 2**30, headroom=0.25)
    page = html_page(Report("t", entries=[entry]))
    charts = page.split("<svg")[1:]
    assert len(charts) == 3 and all('class="usable"' in c for c in charts)
    totals = charts[0]  # total per rank by mesh: one bar of 60 GiB, the line at 60 GiB
    bar_w = _x_of(totals, r'<rect x="170" y="\d+" width="([\d.]+)"')[0]
    line_x = _x_of(totals, r'<line x1="([\d.]+)"[^>]*class="usable"')[0]
    assert (line_x - 170) / bar_w == pytest.approx(60 / 60, rel=0.01)
    per_rank = charts[2]  # stacked: 75 of the 60 + ... scale; the line at 60 GiB high
    ys = _x_of(per_rank, r'<line x1="[\d.]+" y1="([\d.]+)"[^>]*class="usable"')
    assert ys[0] == pytest.approx(30 + 220 - 220 * 60 / 75, abs=0.2)
    assert 'class="usable"' not in html_page(Report("t", entries=[Entry("1x2", est, [est])]))
