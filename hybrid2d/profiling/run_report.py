"""The run report: how the ranks spent each logged step and how balanced they were, as one
self-contained HTML page (inline SVG and CSS like the memory report, no scripts), written to
`RUN/run_report.html` by tools/run_report.py.

It reads `RUN/balance.jsonl` (one JSON object per logged step, written by rank 0: each rank's
step split into compute / comm / data / optimizer / checkpoint / other seconds, the balance
figures and the stragglers named) and, when the run had `--profile.trace_steps`,
`RUN/traces/breakdown.json`. Fields a run did not record (device utilisation on CPU, a host,
the per-dimension figures) are shown as "-"; a line that is not a JSON step record (the last
one of a killed run) is skipped and counted.

Up to `MAX_ROWS` ranks every chart and table has a row per rank; beyond, a row per host (or
per block of consecutive ranks when hosts are many), drawn as the median rank of the group
with its fastest and slowest rank's step time, so 256 ranks read as 32 hosts.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass

from hybrid2d.errors import ConfigError
from hybrid2d.profiling.report import _CSS, _esc, _legend, _svg, _table

PARTS = ("compute_s", "comm_s", "data_s", "optimizer_s", "checkpoint_s", "other_s")
PART_LABELS = {p: p[:-2] for p in PARTS} | {"comm_s": "communication (exposed)"}
PART_COLORS = {
    "compute_s": "#4e79a7",
    "comm_s": "#e15759",
    "data_s": "#f28e2b",
    "optimizer_s": "#59a14f",
    "checkpoint_s": "#b07aa1",
    "other_s": "#bab0ac",
}
DIMS = ("dp_replicate", "dp_shard", "tp")
MAX_ROWS = 16  # ranks drawn one by one; beyond, one row per host
MAX_GROUPS = 64  # hosts drawn one by one; beyond, blocks of consecutive ranks
MAX_COLUMNS = 120  # logged steps drawn one by one; beyond, binned (about 5 pixels a column)
REPORT_NAME = "run_report.html"


@dataclass
class BalanceLog:
    records: list[dict]  # one per logged step, in step order
    skipped: int  # lines that were not a step record


def read_balance(path: str) -> BalanceLog:
    """The step records of a balance.jsonl, tolerant of a torn or foreign line."""
    records, skipped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("ranks"), list) and "step" in rec:
                records.append(rec)
            else:
                skipped += 1
    records.sort(key=lambda r: r["step"])
    return BalanceLog(records, skipped)


@dataclass
class Group:
    label: str
    ranks: list[int]


def groups_of(record: dict) -> tuple[str, list[Group]]:
    """What a row is ("rank", "host" or "block of ranks") and the rows the report draws."""
    ranks = sorted(record["ranks"], key=lambda r: r["rank"])
    if len(ranks) <= MAX_ROWS:
        return "rank", [Group(_rank_label(r), [r["rank"]]) for r in ranks]
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(str(r.get("host") or "?"), []).append(r["rank"])
    if 1 < len(hosts) <= MAX_GROUPS:
        return "host", [Group(f"{h} ({_span(rs)})", rs) for h, rs in hosts.items()]
    size = -(-len(ranks) // MAX_ROWS)
    ids = [r["rank"] for r in ranks]
    blocks = [Group(_span(ids[i : i + size]), ids[i : i + size]) for i in range(0, len(ids), size)]
    return "block of ranks", blocks


def _rank_label(r: dict) -> str:
    coords = r.get("coords")
    where = f" ({','.join(map(str, coords))})" if coords else ""
    host = f" {r['host']}" if r.get("host") else ""
    return f"rank {r['rank']}{where}{host}"


def _span(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"{len(ranks)} ranks"


def _num(r: dict, key: str) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def group_series(
    by_rank: list[dict[int, dict]], group: Group, columns: int = MAX_COLUMNS
) -> list[dict]:
    """Per logged step: the group's median of each part, min / median / max of step_s. More
    logged steps than `columns` are binned: each column the mean of its steps' medians and
    the extremes of their min / max. `by_rank`: each logged step's records by rank."""
    points = []
    for step in by_rank:
        mine = [step[rank] for rank in group.ranks if rank in step]
        if not mine:
            points.append(None)
            continue
        point = {p: _median([_num(r, p) for r in mine]) for p in PARTS}
        steps = [_num(r, "step_s") for r in mine]
        point |= {"min": min(steps), "median": _median(steps), "max": max(steps)}
        points.append(point)
    size = -(-len(points) // columns)
    out = []
    for i in range(0, len(points), size):
        chunk = [p for p in points[i : i + size] if p]
        if not chunk:
            out.append(None)
            continue
        mean = {k: statistics.fmean(p[k] for p in chunk) for k in (*PARTS, "median")}
        out.append(
            mean | {"min": min(p["min"] for p in chunk), "max": max(p["max"] for p in chunk)}
        )
    return out


TABLE_KEYS = ("step_s", *PARTS, "cpu_s")


def run_medians(records: list[dict]) -> dict[int, dict[str, float]]:
    """Each rank's median over the logged steps of each `TABLE_KEYS` figure it recorded."""
    values: dict[int, dict[str, list[float]]] = {}
    for rec in records:
        for r in rec["ranks"]:
            mine = values.setdefault(r.get("rank"), {})
            for key in TABLE_KEYS:
                v = r.get(key)
                if v is not None:
                    mine.setdefault(key, []).append(v)
    return {rank: {k: _median(v) for k, v in keys.items()} for rank, keys in values.items()}


def _median(values) -> float:
    """statistics.median without its generality: the report takes hundreds of thousands."""
    v = sorted(values)
    mid = len(v) // 2
    return float(v[mid]) if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


# ---- charts ------------------------------------------------------------------------------------


def svg_breakdown_rows(
    title: str, records: list[dict], groups: list[Group], named: set[int] = frozenset()
) -> str:
    """One band per row (rank or group), logged steps left to right: the parts of the step
    stacked (the group's median rank), with the group's slowest and fastest step as lines.
    A row holding a rank in `named` (the stragglers) has its label in red."""
    left, plot_w, row_h, gap, top = 220, 640, 34, 6, 30
    by_rank = [{r.get("rank"): r for r in rec["ranks"]} for rec in records]
    series = [group_series(by_rank, g) for g in groups]
    vmax = max([p["max"] for s in series for p in s if p] + [1e-9])
    vmax = max(vmax, max(sum(p[k] for k in PARTS) for s in series for p in s if p))
    n = max(1, len(series[0]))
    col = plot_w / n
    height = top + len(groups) * (row_h + gap) + 48
    parts = []
    many = any(len(g.ranks) > 1 for g in groups)
    for i, (g, s) in enumerate(zip(groups, series, strict=True)):
        y0 = top + i * (row_h + gap) + row_h  # baseline of the row
        cls = "row straggler" if named & set(g.ranks) else "row"
        parts.append(
            f'<text x="{left - 6}" y="{y0 - row_h / 2 + 4:.0f}" text-anchor="end" class="{cls}">'
            f"{_esc(g.label)}</text>"
        )
        parts.append(f'<line x1="{left}" y1="{y0}" x2="{left + plot_w}" y2="{y0}" stroke="#ccc"/>')
        below = [0.0] * n
        for part in PARTS:
            upper = [below[j] + (s[j][part] if s[j] else 0.0) for j in range(n)]
            if any(u > b for u, b in zip(upper, below, strict=True)):
                pts = _band(below, upper, left, col, y0, row_h / vmax)
                parts.append(
                    f'<polygon points="{pts}" fill="{PART_COLORS[part]}" class="part">'
                    f"<title>{_esc(g.label)}: {_esc(PART_LABELS[part])}</title></polygon>"
                )
            below = upper
        if many:
            for key, style in (("max", ""), ("min", ' stroke-dasharray="3,2"')):
                pts = _steps_line([p[key] if p else 0.0 for p in s], left, col, y0, row_h / vmax)
                parts.append(
                    f'<polyline points="{pts}" fill="none" stroke="#222" stroke-width="1"{style}>'
                    f"<title>{_esc(g.label)}: {key} step time</title></polyline>"
                )
        last = next((p for p in reversed(s) if p), None)
        if last:
            spread = f", max {last['max']:.3g}" if many and last["max"] > last["min"] else ""
            parts.append(
                f'<text x="{left + plot_w + 6}" y="{y0 - row_h / 2 + 4:.0f}" class="v">'
                f"{last['median']:.3g} s{spread}</text>"
            )
    axis_y = top + len(groups) * (row_h + gap) + 4
    first, last_step = records[0]["step"], records[-1]["step"]
    parts += [
        f'<text x="{left}" y="{axis_y + 10}" class="v">step {first}</text>',
        f'<text x="{left + plot_w}" y="{axis_y + 10}" text-anchor="end" class="v">'
        f"step {last_step} (row height: {vmax:.3g} s)</text>",
    ]
    legend = [(PART_LABELS[p], PART_COLORS[p]) for p in PARTS]
    items, x = _legend(legend, left, height - 12)
    parts += items
    if many:
        parts += [
            f'<line x1="{x}" y1="{height - 16}" x2="{x + 16}" y2="{height - 16}" stroke="#222"/>',
            f'<text x="{x + 20}" y="{height - 12}">slowest / fastest rank of the row</text>',
        ]
    return _svg(title, max(left + plot_w + 120, x + 230), height, parts)


def _band(below, upper, left, col, y0, scale) -> str:
    """Points of the area between two step functions (one flat column per logged step)."""
    top = [(left + j * col + d, y0 - v * scale) for j, v in enumerate(upper) for d in (0, col)]
    bottom = [(left + j * col + d, y0 - v * scale) for j, v in enumerate(below) for d in (0, col)]
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in top + bottom[::-1])


def _steps_line(values, left, col, y0, scale) -> str:
    pts = [(left + j * col + d, y0 - v * scale) for j, v in enumerate(values) for d in (0, col)]
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)


def svg_ranges(title: str, rows: list[tuple[str, float, float, float]], unit: str = "s") -> str:
    """Horizontal bars of each row's median, with a whisker from its min to its max."""
    left, width, bar, top = 220, 460, 14, 30
    vmax = max([r[3] for r in rows] + [1e-9])
    height = top + len(rows) * (bar + 4) + 20
    parts = []
    for i, (label, lo, mid, hi) in enumerate(rows):
        y = top + i * (bar + 4)
        w = max(1.0, width * mid / vmax)
        parts += [
            f'<text x="{left - 6}" y="{y + bar - 3}" text-anchor="end" class="row">'
            f"{_esc(label)}</text>",
            f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="#4e79a7" '
            f'class="bar"><title>{_esc(label)}: {mid:.4g} {unit}</title></rect>',
        ]
        if hi > lo:
            x1, x2 = left + width * lo / vmax, left + width * hi / vmax
            ym = y + bar / 2
            parts.append(
                f'<path d="M{x1:.1f},{ym - 4:.1f}v8M{x1:.1f},{ym:.1f}H{x2:.1f}M{x2:.1f},'
                f'{ym - 4:.1f}v8" stroke="#222" fill="none"><title>{_esc(label)}: '
                f"{lo:.4g} to {hi:.4g} {unit}</title></path>"
            )
        parts.append(
            f'<text x="{left + width * max(hi, mid) / vmax + 6:.1f}" y="{y + bar - 3}" '
            f'class="v">{mid:.3g}{"" if hi <= lo else f" ({lo:.3g}-{hi:.3g})"} {unit}</text>'
        )
    return _svg(title, left + width + 140, height, parts)


def svg_ratio_lines(title: str, records: list[dict]) -> str:
    """max / median compute over the logged steps, overall and per mesh dimension."""
    left, plot_w, plot_h, top = 60, 640, 160, 30
    lines: dict[str, list[float | None]] = {"all ranks": []}
    for d in DIMS:
        lines[d] = []
    for rec in records:
        bal = rec.get("balance") or {}
        lines["all ranks"].append(bal.get("compute_max_over_median"))
        per_dim = bal.get("per_dim") or {}
        for d in DIMS:
            lines[d].append((per_dim.get(d) or {}).get("max_over_median"))
    lines = {k: v for k, v in lines.items() if any(x is not None for x in v)}
    values = [x for v in lines.values() for x in v if x is not None]
    lo = min([1.0, *values])
    hi = max([lo + 0.05, *values])
    n = max(1, len(records) - 1)
    colors = dict(zip(lines, ("#222", "#4e79a7", "#f28e2b", "#e15759"), strict=False))

    def y(v):
        return top + plot_h - plot_h * (v - lo) / (hi - lo)

    parts = [
        f'<line x1="{left}" y1="{y(1.0):.1f}" x2="{left + plot_w}" y2="{y(1.0):.1f}" '
        'stroke="#aaa" stroke-dasharray="4,3"/>',
        f'<text x="{left - 4}" y="{y(hi) + 4:.1f}" text-anchor="end" class="v">{hi:.3g}</text>',
        f'<text x="{left - 4}" y="{y(lo) + 4:.1f}" text-anchor="end" class="v">{lo:.3g}</text>',
    ]
    for name, vals in lines.items():
        pts = [
            f"{left + plot_w * j / n:.1f},{y(v):.1f}" for j, v in enumerate(vals) if v is not None
        ]
        parts.append(
            f'<polyline points="{" ".join(pts)}" fill="none" stroke="{colors[name]}" '
            f'stroke-width="{2 if name == "all ranks" else 1.2}" class="ratio">'
            f"<title>{_esc(name)}</title></polyline>"
        )
    axis = top + plot_h + 14
    parts += [
        f'<text x="{left}" y="{axis}" class="v">step {records[0]["step"]}</text>',
        f'<text x="{left + plot_w}" y="{axis}" text-anchor="end" class="v">'
        f"step {records[-1]['step']}</text>",
    ]
    parts += _legend([(k, c) for k, c in colors.items()], left, top + plot_h + 36)[0]
    return _svg(title, left + plot_w + 40, top + plot_h + 46, parts)


# ---- the page ----------------------------------------------------------------------------------


def _fmt(v, spec: str = ".3g", unit: str = "") -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v:{spec}}{unit}"


def _summary_rows(log: BalanceLog) -> list[list[str]]:
    recs = log.records
    last = recs[-1]
    mesh = last.get("mesh") or {}
    ratios = [
        (rec["balance"]["compute_max_over_median"], rec["step"])
        for rec in recs
        if isinstance((rec.get("balance") or {}).get("compute_max_over_median"), (int, float))
    ]
    hosts = {r.get("host") for r in last["ranks"] if r.get("host")}
    rows = [
        ["mesh", " x ".join(f"{d}={mesh[d]}" for d in DIMS if d in mesh) or "-"],
        ["ranks, hosts", f"{len(last['ranks'])}, {len(hosts) or '-'}"],
        ["logged steps", f"{len(recs)} (steps {recs[0]['step']}-{last['step']})"],
    ]
    if ratios:
        worst = max(ratios)
        rows += [
            ["compute max / median, last step", f"{ratios[-1][0]:.3f}"],
            [
                "compute max / median, median over steps",
                f"{statistics.median(r for r, _ in ratios):.3f}",
            ],
            ["compute max / median, worst", f"{worst[0]:.3f} at step {worst[1]}"],
        ]
    bal = last.get("balance") or {}
    if "slowest_rank" in bal:
        rows.append(
            ["slowest rank, last step", f"{bal['slowest_rank']} on {bal.get('slowest_host', '-')}"]
        )
    slowest = [(rec.get("balance") or {}).get("slowest_rank") for rec in recs]
    slowest = [s for s in slowest if s is not None]
    if slowest:
        top = statistics.mode(slowest)
        rows.append(
            ["slowest most often", f"rank {top} ({slowest.count(top)} of {len(slowest)} steps)"]
        )
    for d in DIMS:
        dim = (bal.get("per_dim") or {}).get(d)
        if dim:
            rows.append(
                [
                    f"{d}: slowest index, max / median (last step)",
                    f"{dim.get('index', '-')}, {_fmt(dim.get('max_over_median'), '.3f')}",
                ]
            )
    if log.skipped:
        rows.append(["lines skipped", f"{log.skipped} (not a step record: a torn last line?)"])
    return rows


def _straggler_rows(records: list[dict]) -> list[list[str]]:
    seen: dict[int, dict] = {}
    for rec in records:
        for s in rec.get("stragglers") or []:
            if "rank" not in s:
                continue
            row = seen.setdefault(
                s["rank"],
                {"host": s.get("host"), "coords": s.get("coords"), "steps": [], "excess": []},
            )
            row["steps"].append(rec["step"])
            if isinstance(s.get("excess"), (int, float)):
                row["excess"].append(s["excess"])
    out = []
    for rank, row in sorted(seen.items(), key=lambda kv: -max(kv[1]["excess"] or [0])):
        coords = ",".join(map(str, row["coords"])) if row["coords"] else "-"
        out.append(
            [
                str(rank),
                row["host"] or "-",
                coords,
                f"{row['steps'][0]}-{row['steps'][-1]} ({len(row['steps'])} logged)",
                _fmt(max(row["excess"]) if row["excess"] else None, ".1%"),
            ]
        )
    return out


def _rank_table(
    records: list[dict], groups: list[Group], medians: dict[int, dict[str, float]]
) -> tuple[list[str], list[list[str]]]:
    """Per row: the median over the run of each part; groups: min / median / max of compute."""
    last = {r["rank"]: r for r in records[-1]["ranks"]}
    if all(len(g.ranks) == 1 for g in groups):
        header = [
            "rank",
            "host",
            "coords",
            "step s",
            *(PART_LABELS[p] for p in PARTS),
            "CPU s",
            "device util",
            "device memory",
        ]
        rows = []
        for g in groups:
            rank = g.ranks[0]
            r = last.get(rank, {})
            mem = r.get("device_mem_bytes")
            rows.append(
                [
                    str(rank),
                    r.get("host") or "-",
                    ",".join(map(str, r["coords"])) if r.get("coords") else "-",
                    *(_fmt(medians[rank].get(k), ".3f") for k in ("step_s", *PARTS, "cpu_s")),
                    _fmt(r.get("device_util"), ".0%"),
                    "-" if not isinstance(mem, (int, float)) else f"{mem / 2**30:.2f} GiB",
                ]
            )
        return header, rows
    header = [
        "row",
        "ranks",
        "compute s min",
        "median",
        "max",
        "slowest rank",
        "comm s median",
        "step s max",
    ]
    rows = []
    for g in groups:
        per = {rank: medians[rank].get("compute_s", 0.0) for rank in g.ranks}
        comm = [medians[rank].get("comm_s", 0.0) for rank in g.ranks]
        step = [medians[rank].get("step_s", 0.0) for rank in g.ranks]
        slow = max(per, key=per.get)
        rows.append(
            [
                g.label,
                str(len(g.ranks)),
                f"{min(per.values()):.3f}",
                f"{statistics.median(per.values()):.3f}",
                f"{per[slow]:.3f}",
                str(slow),
                f"{statistics.median(comm):.3f}",
                f"{max(step):.3f}",
            ]
        )
    return header, rows


def _trace_blocks(run_dir: str) -> list[str]:
    path = os.path.join(run_dir, "traces", "breakdown.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        data = json.load(f)
    ranks = data.get("ranks") or []
    if not ranks:
        return []
    a, b = data.get("steps", ["?", "?"])
    keys = ("wall_s", "compute_s", "comm_s", "overlap_s", "idle_s")
    if len(ranks) <= MAX_ROWS:
        rows = [[str(r["rank"]), *(f"{r.get(k, 0):.3f}" for k in keys)] for r in ranks]
    else:
        rows = [
            [name, *(f"{pick(r.get(k, 0) for r in ranks):.3f}" for k in keys)]
            for name, pick in (("min", min), ("median", statistics.median), ("max", max))
        ]
    return [
        f"<h2>Traces of steps {_esc(a)}-{_esc(b)} (torch.profiler)</h2>",
        f"<p>traces/rank*.pt.trace.json; compute on {_esc(ranks[0].get('lanes', '-'))}, "
        "seconds over the traced steps</p>",
        _table(["rank", "wall", "compute", "communication", "overlap", "idle"], rows),
    ]


def render(run_dir: str) -> str:
    """The page for a run directory that has a balance.jsonl."""
    path = os.path.join(run_dir, "balance.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(
            f"--run-dir {run_dir} has no balance.jsonl: give a run directory that "
            "recipes/llama.py wrote (it logs per-rank figures every metrics.log_every steps)"
        )
    log = read_balance(path)
    if not log.records:
        raise ConfigError(f"{path} holds no step record ({log.skipped} lines skipped)")
    recs = log.records
    per, groups = groups_of(recs[-1])
    grouped = per != "rank"
    n_ranks = len(recs[-1]["ranks"])
    title = f"Run {os.path.basename(os.path.abspath(run_dir))}: {n_ranks} ranks"
    medians = run_medians(recs)
    compute_rows = []
    for g in groups:
        vals = [medians[rank].get("compute_s", 0.0) for rank in g.ranks]
        compute_rows.append((g.label, min(vals), statistics.median(vals), max(vals)))
    header, table = _rank_table(recs, groups, medians)
    stragglers = _straggler_rows(recs)
    body = [
        f"<h1>{_esc(title)}</h1>",
        _table(["", "value"], _summary_rows(log)),
        "<h2>Step time by part, over the run</h2>",
        "<p>"
        + (
            f"{n_ranks} ranks: one row per {per}, drawn as its median rank; the lines are its "
            "slowest and fastest rank's step time"
            if grouped
            else "one row per rank (coordinates dp_replicate,dp_shard,tp)"
        )
        + "; all rows share one scale</p>",
        svg_breakdown_rows(
            f"step breakdown per {per}, logged steps left to right (last step's time at the right)",
            recs,
            groups,
            {s["rank"] for rec in recs for s in rec.get("stragglers") or [] if "rank" in s},
        ),
        "<h2>Load balance</h2>",
        svg_ratio_lines("compute: slowest rank / median rank, per logged step", recs),
        svg_ranges(
            f"compute per {per}, median over the run"
            + (" (whiskers: fastest to slowest rank)" if grouped else ""),
            compute_rows,
        ),
        "<h2>Stragglers</h2>",
        _table(["rank", "host", "coords", "steps named", "largest excess"], stragglers)
        if stragglers
        else "<p>none named</p>",
        f"<h2>Per {per}, medians over the run</h2>",
        _table(header, table),
        *_trace_blocks(run_dir),
    ]
    if os.path.isfile(os.path.join(run_dir, "memory", "memory_report.html")):
        body.append(
            '<p>Memory of this run: <a href="memory/memory_report.html">memory report</a></p>'
        )
    css = _CSS + (
        "svg.chart .row { font-size: 11px; } svg.chart .straggler { fill: #b00; "
        "font-weight: bold; } td { white-space: nowrap; } body { max-width: 1200px; }\n"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8"/>\n'
        f"<title>{_esc(title)}</title>\n<style>{css}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def write_run_report(run_dir: str, out: str | None = None) -> str:
    """Write the page (default RUN/run_report.html) and return its path."""
    page = render(run_dir)
    out = out or os.path.join(run_dir, REPORT_NAME)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, out)  # never a half-written report
    return out
