"""The run report (tools/run_report.py) over synthetic balance.jsonl files of 8 ranks and of 256
ranks on 32 hosts, written as the per-rank breakdown's schema says; and the page in a real
headless browser when chromium is installed (CI has none: that test skips)."""

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from hybrid2d.profiling.run_report import read_balance
from tests.launch import REPO

PARTS = {"compute_s": 0.60, "comm_s": 0.12, "data_s": 0.02, "optimizer_s": 0.05,
         "checkpoint_s": 0.0, "other_s": 0.01}  # fmt: skip


def balance_records(mesh, per_host, slow_rank, steps=range(10, 310, 10), slow_from=150):
    """One record per logged step; `slow_rank` computes 30% longer from step `slow_from`, and
    every 100th step is a checkpoint step."""
    rep, shard, tp = mesh
    world = rep * shard * tp
    out = []
    for step in steps:
        ranks = []
        for r in range(world):
            parts = dict(PARTS)
            parts["compute_s"] *= 1 + 0.01 * ((r * 7 + step) % 5)  # a little noise
            if r == slow_rank and step >= slow_from:
                parts["compute_s"] *= 1.3
            if step % 100 == 0:
                parts["checkpoint_s"] = 0.2
            coords = [r // (shard * tp), r // tp % shard, r % tp]
            ranks.append(
                {"rank": r, "host": f"host-{r // per_host:02d}", "coords": coords,
                 "step_s": sum(parts.values()), **parts, "cpu_s": 0.7, "device_util": 0.93,
                 "device_mem_bytes": 60 * 2**30}
            )  # fmt: skip
        compute = sorted(x["compute_s"] for x in ranks)
        median = compute[len(compute) // 2]
        slowest = max(ranks, key=lambda x: x["compute_s"])
        per_dim = {}  # along each mesh dim: the index whose ranks compute longest on average
        for i, d in enumerate(("dp_replicate", "dp_shard", "tp")):
            means = {}
            for x in ranks:
                means.setdefault(x["coords"][i], []).append(x["compute_s"])
            means = {k: sum(v) / len(v) for k, v in means.items()}
            ordered = sorted(means.values())
            worst = max(means, key=means.get)
            per_dim[d] = {
                "index": worst,
                "max_over_median": means[worst] / ordered[len(ordered) // 2],
            }
        stragglers = []
        if slowest["compute_s"] / median > 1.2:
            stragglers.append(
                {"rank": slowest["rank"], "host": slowest["host"], "coords": slowest["coords"],
                 "excess": slowest["compute_s"] / median - 1}
            )  # fmt: skip
        out.append(
            {"step": step, "time": 1.8e9 + step,
             "mesh": {"dp_replicate": rep, "dp_shard": shard, "tp": tp}, "ranks": ranks,
             "balance": {"compute_max_over_median": slowest["compute_s"] / median,
                         "slowest_rank": slowest["rank"], "slowest_host": slowest["host"],
                         "per_dim": per_dim},
             "stragglers": stragglers}
        )  # fmt: skip
    return out


def write_run(path, records, extra_lines=()):
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    (path / "balance.jsonl").write_text("\n".join(lines) + "\n")
    return path


def report(run_dir) -> str:
    proc = subprocess.run(
        [sys.executable, "tools/run_report.py", "--run-dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return (run_dir / "run_report.html").read_text()


def svgs(page: str) -> list[ET.Element]:
    root = ET.fromstring(page.split("\n", 1)[1])  # well-formed after the doctype
    return root.findall(".//{http://www.w3.org/2000/svg}svg")


def row_labels(svg: ET.Element, cls: str = "row") -> list[str]:
    texts = svg.iter("{http://www.w3.org/2000/svg}text")
    return [t.text for t in texts if cls in (t.get("class") or "").split()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    small = write_run(base / "r8", balance_records((1, 4, 2), 4, slow_rank=5))
    large = write_run(base / "r256", balance_records((1, 32, 8), 8, slow_rank=77))
    return small, large


def test_eight_ranks_one_row_each_and_the_straggler_named(runs):
    page = report(runs[0])
    breakdown, ratio, compute = svgs(page)[:3]
    labels = row_labels(breakdown)
    assert labels == [f"rank {r} (0,{r // 2},{r % 2}) host-{r // 4:02d}" for r in range(8)]
    assert row_labels(compute) == labels
    assert row_labels(breakdown, "straggler") == ["rank 5 (0,2,1) host-01"]
    # each rank's band: compute, communication, data, optimizer, other, and checkpoint (steps
    # 100, 200, 300): six polygons a row
    assert len([p for p in breakdown.iter() if p.get("class") == "part"]) == 8 * 6
    stragglers = page.split("<h2>Stragglers</h2>", 1)[1].split("</table>", 1)[0]
    assert re.search(
        r"<td>5</td><td>host-01</td><td>0,2,1</td><td>150-300 \(16 logged\)", stragglers
    )
    assert "slowest most often" in page and "rank 5 (16 of 30 steps)" in page


def test_256_ranks_on_32_hosts_one_row_per_host(runs):
    page = report(runs[1])
    breakdown, ratio, compute = svgs(page)[:3]
    labels = row_labels(breakdown)
    assert len(labels) == 32 and labels[9] == "host-09 (ranks 72-79)"
    assert row_labels(breakdown, "straggler") == ["host-09 (ranks 72-79)"]
    # the host's median rank as a band, and its slowest and fastest rank as two lines
    assert len([p for p in breakdown.iter() if p.get("class") == "part"]) == 32 * 6
    assert len(list(breakdown.iter("{http://www.w3.org/2000/svg}polyline"))) == 32 * 2
    table = page.split("<h2>Per host, medians over the run</h2>", 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 1 + 32
    assert "<td>host-09 (ranks 72-79)</td><td>8</td>" in table and "<td>77</td>" in table
    assert len(page) < 400_000  # 256 ranks x 30 steps drawn as 32 rows, not 7,680 bars
    assert all(float(svg.get("width")) <= 1150 for svg in svgs(page))  # fits the page's width


def test_missing_optional_fields_and_a_torn_line(tmp_path):
    records = balance_records((1, 2, 1), 2, slow_rank=None, steps=[1, 2])
    for rec in records:
        del rec["balance"], rec["stragglers"]
        for r in rec["ranks"]:
            for key in ("host", "coords", "device_util", "device_mem_bytes", "cpu_s", "data_s"):
                r.pop(key)
    run = write_run(tmp_path / "run", records, ['{"step": 3, "ranks": [{"ra'])
    assert read_balance(str(run / "balance.jsonl")).skipped == 1
    page = report(run)
    assert row_labels(svgs(page)[0]) == ["rank 0", "rank 1"]
    assert "1 (not a step record: a torn last line?)" in page and "none named" in page


def test_a_run_dir_without_balance_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/run_report.py", "--run-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "has no balance.jsonl" in proc.stderr
    assert not (tmp_path / "run_report.html").exists()


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def headless(*args: str) -> subprocess.CompletedProcess:
    browser = chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(chromium() is None, reason="no chromium (apt-get install -y chromium)")
@pytest.mark.parametrize("which, rows", [(0, 8), (1, 32)], ids=["8-ranks", "256-ranks"])
def test_the_page_in_a_headless_browser(runs, tmp_path, which, rows):
    """chromium reads the page (its DOM holds the charts' bands) and paints it: the
    screenshot is not blank and has the breakdown's compute colour."""
    Image = pytest.importorskip("PIL.Image")
    run = runs[which]
    report(run)
    url = (run / "run_report.html").as_uri()
    dom = headless("--dump-dom", url).stdout
    assert dom.count('class="part"') == rows * 6 and dom.count("<svg") >= 3
    shot = tmp_path / "page.png"
    headless("--window-size=1280,1200", f"--screenshot={shot}", url)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1200)
    colours = image.getcolors(1280 * 1200)
    count = {c: n for n, c in colours}
    compute_blue, white = (0x4E, 0x79, 0xA7), (255, 255, 255)
    assert count.get(compute_blue, 0) > 5_000  # the breakdown's compute bands are painted
    assert count.get(white, 0) < 0.95 * 1280 * 1200  # not blank


def test_many_logged_steps_are_binned_into_columns(tmp_path):
    """300 logged steps draw as 100 columns of 3 steps (at most MAX_COLUMNS = 120), each the
    mean of its steps: the page stays small whatever the run's length."""
    records = balance_records((1, 2, 1), 2, slow_rank=None, steps=range(1, 301))
    page = report(write_run(tmp_path / "run", records))
    compute = next(p for p in svgs(page)[0].iter() if p.get("class") == "part")
    points = [tuple(map(float, xy.split(","))) for xy in compute.get("points").split()]
    assert len(points) == 4 * 100  # two corners a column, along the top and back along the base
    # the first column's height: the mean of steps 1-3's compute, on the row's scale
    heights = [r["ranks"][0]["compute_s"] for r in records[:3]]
    vmax = max(sum(x[p] for p in PARTS) for r in records for x in r["ranks"])
    base = points[-1][1]
    assert base - points[0][1] == pytest.approx(34 * (sum(heights) / 3) / vmax, abs=0.06)


@pytest.mark.parametrize("world", [8, 256])
def test_traced_steps_are_on_the_page(tmp_path, world):
    """With traces/breakdown.json (--profile.trace_steps): a row per rank up to 16 ranks, else
    min / median / max over the ranks."""
    run = write_run(tmp_path / "run", balance_records((1, world // 2, 2), 8, None, steps=[1, 2]))
    ranks = [
        {"rank": r, "steps": [3, 4], "wall_s": 2.0, "compute_s": 1.0 + r / 1000, "comm_s": 0.8,
         "overlap_s": 0.2, "idle_s": 0.4 - r / 1000, "lanes": "device streams", "collectives": {}}
        for r in range(world)
    ]  # fmt: skip
    (run / "traces").mkdir()
    (run / "traces" / "breakdown.json").write_text(json.dumps({"steps": [3, 4], "ranks": ranks}))
    page = report(run)
    table = page.split("<h2>Traces of steps 3-4 (torch.profiler)</h2>", 1)[1].split("</table>")[0]
    cells = re.findall(r"<tr><td>([^<]+)</td><td>[^<]+</td><td>([^<]+)</td>", table)
    if world == 8:
        assert cells == [(str(r), f"{1.0 + r / 1000:.3f}") for r in range(8)]
    else:
        middle = f"{(1.127 + 1.128) / 2:.3f}"  # ranks 127 and 128 of 256
        assert cells == [("min", "1.000"), ("median", middle), ("max", "1.255")]
