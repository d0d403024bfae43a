"""The memory report's HTML stays readable on large meshes and says what would fit."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

from hybrid2d.profiling.profiler import load_measured
from hybrid2d.profiling.report import group_identical_ranks
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
