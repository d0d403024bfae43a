"""The memory report: measured, estimated and simulated figures side by side, as Markdown and as
one self-contained HTML page (inline SVG charts and CSS, no scripts, no external files).

A report is a list of entries, one per mesh. Each entry may hold any of: the analytic estimate
(`estimate.Estimate.to_dict()`, for rank 0 and optionally every rank), the simulated rank
(`simulate.simulate` result) and the measured ranks of a real run (`measure.StepMemory` dicts,
one per rank). Missing sources are left out of the tables and charts.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "peak")
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "communication": "communication buffers",
    "peak": "total (peak)",
}
STACKED = ("parameters", "gradients", "optimizer", "communication", "activations")
SOURCES = ("measured", "estimated", "simulated")
COLORS = {
    "measured": "#1f77b4",
    "estimated": "#ff7f0e",
    "simulated": "#2ca02c",
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer": "#e15759",
    "communication": "#76b7b2",
    "activations": "#59a14f",
}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class Entry:
    mesh: str
    estimate: dict | None = None  # Estimate.to_dict() for rank 0
    estimate_per_rank: list[dict] = field(default_factory=list)
    simulated: dict | None = None  # simulate() result (its "memory" is a StepMemory dict)
    measured: list[dict] = field(default_factory=list)  # StepMemory dicts, one per rank
    device_memory: int | None = None
    headroom: float = 0.0
    remedy: str = ""  # for a mesh that does not fit: what would (as the terminal prints it)

    def values(self, source: str, rank: int = 0) -> dict[str, int] | None:
        if source == "estimated" and self.estimate:
            return {k: self.estimate[k] for k in CATEGORIES}
        if source == "simulated" and self.simulated:
            return {k: self.simulated["memory"][k] for k in CATEGORIES}
        if source == "measured" and self.measured:
            mine = [m for m in self.measured if m.get("rank", 0) == rank] or self.measured[:1]
            return {k: mine[0][k] for k in CATEGORIES}
        return None

    def reference(self) -> str | None:
        """The source the others' differences are relative to: measured, else simulated."""
        return next((s for s in ("measured", "simulated") if self.values(s) is not None), None)

    def sources(self) -> list[str]:
        return [s for s in SOURCES if self.values(s) is not None]

    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        best = self.values("simulated") or self.values("estimated") or self.values("measured")
        return best["peak"] <= self.device_memory * (1 - self.headroom)


@dataclass
class Report:
    title: str
    summary: list[tuple[str, str]] = field(default_factory=list)  # (setting, value)
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _diff(a: int | None, b: int | None) -> str:
    if a is None or b is None or not b:
        return ""
    return f" ({100 * (a - b) / b:+.1f}%)"


# ---- Markdown -----------------------------------------------------------------------------


def markdown(rep: Report) -> str:
    out = [f"# {rep.title}", ""]
    if rep.summary:
        out += ["| setting | value |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in rep.summary]
        out.append("")
    fit_rows = [e for e in rep.entries if e.fits() is not None]
    if fit_rows:
        mem = fit_rows[0].device_memory
        head = fit_rows[0].headroom
        out += [
            f"## Which meshes fit in {fmt_bytes(mem)} per device "
            f"(keeping {head:.0%} for the allocator and the runtime)",
            "",
            "| mesh | total per rank | fits | what would fit |",
            "|---|---|---|---|",
        ]
        for e in fit_rows:
            best = e.values("simulated") or e.values("estimated") or e.values("measured")
            ok = "yes" if e.fits() else "no"
            out.append(f"| {e.mesh} | {fmt_bytes(best['peak'])} | {ok} | {e.remedy} |")
        out.append("")
    for e in rep.entries:
        srcs = e.sources()
        out += [f"## Mesh {e.mesh} (rank 0)", ""]
        out.append("| category | " + " | ".join(srcs) + " |")
        out.append("|---|" + "---|" * len(srcs))
        ref_src = e.reference()
        ref = e.values(ref_src) if ref_src else None
        for cat in CATEGORIES:
            cells = []
            for s in srcs:
                v = e.values(s)[cat]
                diff = _diff(v, ref[cat]) if ref is not None and s != ref_src else ""
                cells.append(fmt_bytes(v) + diff)
            out.append(f"| {LABELS[cat]} | " + " | ".join(cells) + " |")
        out.append("")
        if e.estimate:
            est = e.estimate
            out.append(
                f"Estimated peak at: {est['peak_phase']}; micro batch {est['micro_batch']} x "
                f"{est['micro_batches']}, sequence {est['seq_len']}."
            )
        if e.simulated:
            s = e.simulated
            out.append(
                f"Simulated: rank {s['rank']} of {s['world_size']}, {s['mixed_precision']}, "
                f"micro batch {s['micro_batch']}, peak in {s['memory']['peak_phase']}; "
                f"{s['wall_s']:.0f} s, peak RSS {fmt_bytes(s['rss_peak'])}."
            )
        if e.measured:
            out += ["", "| rank | " + " | ".join(LABELS[c] for c in CATEGORIES) + " | RSS |"]
            out.append("|---|" + "---|" * (len(CATEGORIES) + 1))
            for m in sorted(e.measured, key=lambda m: m["rank"]):
                row = " | ".join(fmt_bytes(m[c]) for c in CATEGORIES)
                out.append(f"| {m['rank']} | {row} | {fmt_bytes(m.get('rss'))} |")
        out.append("")
    if rep.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in rep.notes] + [""]
    return "\n".join(out)


# ---- HTML with inline SVG ------------------------------------------------------------------


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def svg_grouped_bars(title: str, groups: list[tuple[str, list[tuple[str, float]]]]) -> str:
    """Horizontal bars: one group per label, one bar per (series, value)."""
    bar, gap, left, width = 14, 10, 170, 460
    vmax = max((v for _, bars in groups for _, v in bars), default=1) or 1
    rows = sum(len(b) for _, b in groups)
    height = 40 + rows * bar + len(groups) * gap + 30
    series = []
    for _, bars in groups:
        for s, _ in bars:
            if s not in series:
                series.append(s)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{left + width + 120}" '
        f'height="{height}" role="img" aria-label="{_esc(title)}">',
        f"<title>{_esc(title)}</title>",
        f'<text x="4" y="16" class="ct">{_esc(title)}</text>',
    ]
    y = 30
    for label, bars in groups:
        parts.append(
            f'<text x="{left - 6}" y="{y + bar * len(bars) / 2 + 4:.0f}" text-anchor="end">'
            f"{_esc(label)}</text>"
        )
        for s, v in bars:
            w = max(1.0, width * v / vmax)
            parts.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 2}" '
                f'fill="{COLORS.get(s, "#888")}"><title>{_esc(s)}: {_esc(fmt_bytes(v))}</title>'
                "</rect>"
            )
            parts.append(
                f'<text x="{left + w + 4:.1f}" y="{y + bar - 4}" class="v">{_esc(fmt_bytes(v))}'
                "</text>"
            )
            y += bar
        y += gap
    x = left
    for s in series:
        color = COLORS.get(s, "#888")
        parts.append(f'<rect x="{x}" y="{height - 18}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{x + 14}" y="{height - 9}">{_esc(s)}</text>')
        x += 14 + 8 * len(s) + 16
    parts.append("</svg>")
    return "\n".join(parts)


def svg_stacked_bars(
    title: str, bars: list[tuple[str, dict[str, float]]], marks: dict[str, float] | None = None
) -> str:
    """Vertical stacked bars (one per rank) by category; `marks` draws a tick per bar label."""
    n = max(1, len(bars))
    bw = max(6, min(40, 560 // n))
    left, top, plot_h = 60, 30, 220
    vmax = max([sum(v.values()) for _, v in bars] + list((marks or {}).values()) + [1])
    legend_w = sum(28 + 7 * len(LABELS[c]) for c in STACKED) + (140 if marks else 0)
    width = left + n * (bw + 4) + 20
    height = top + plot_h + 60
    svg_w = max(width, left + legend_w)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{svg_w}" '
        f'height="{height}" role="img" aria-label="{_esc(title)}">',
        f"<title>{_esc(title)}</title>",
        f'<text x="4" y="16" class="ct">{_esc(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 10}" y2="{top + plot_h}" '
        'stroke="#444"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" class="v">'
        f"{_esc(fmt_bytes(vmax))}</text>",
    ]
    for i, (label, values) in enumerate(bars):
        x = left + 4 + i * (bw + 4)
        y = top + plot_h
        for cat in STACKED:
            v = values.get(cat, 0)
            h = plot_h * v / vmax
            y -= h
            parts.append(
                f'<rect x="{x}" y="{y:.1f}" width="{bw}" height="{h:.1f}" '
                f'fill="{COLORS[cat]}"><title>{_esc(label)} {_esc(LABELS[cat])}: '
                f"{_esc(fmt_bytes(v))}</title></rect>"
            )
        if marks and label in marks:
            my = top + plot_h - plot_h * marks[label] / vmax
            parts.append(
                f'<line x1="{x - 2}" y1="{my:.1f}" x2="{x + bw + 2}" y2="{my:.1f}" '
                f'stroke="{COLORS["estimated"]}" stroke-width="3"><title>estimated '
                f"{_esc(fmt_bytes(marks[label]))}</title></line>"
            )
        if n <= 32 or i % max(1, n // 16) == 0:
            parts.append(
                f'<text x="{x + bw / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle" '
                f'class="v">{_esc(label)}</text>'
            )
    x = left
    for cat in STACKED:
        parts.append(
            f'<rect x="{x}" y="{height - 22}" width="10" height="10" fill="{COLORS[cat]}"/>'
        )
        parts.append(f'<text x="{x + 14}" y="{height - 13}">{_esc(LABELS[cat])}</text>')
        x += 14 + 7 * len(LABELS[cat]) + 14
    if marks:
        parts.append(
            f'<line x1="{x}" y1="{height - 17}" x2="{x + 12}" y2="{height - 17}" '
            f'stroke="{COLORS["estimated"]}" stroke-width="3"/>'
        )
        parts.append(f'<text x="{x + 16}" y="{height - 13}">estimated peak</text>')
    parts.append("</svg>")
    return "\n".join(parts)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
svg.chart { display: block; margin: 8px 0 16px; font-size: 11px; }
svg.chart .ct { font-size: 13px; font-weight: bold; }
.no { color: #b00; font-weight: bold; } .yes { color: #070; font-weight: bold; }
"""


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    out = [f'<table class="{cls}">' if cls else "<table>", "<tr>"]
    out += [f"<th>{_esc(h)}</th>" for h in header]
    out.append("</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def html_page(rep: Report) -> str:
    body = [f"<h1>{_esc(rep.title)}</h1>"]
    if rep.summary:
        body.append(_table(["setting", "value"], [[_esc(k), _esc(v)] for k, v in rep.summary]))
    fit_rows = [e for e in rep.entries if e.fits() is not None]
    if fit_rows:
        mem, head = fit_rows[0].device_memory, fit_rows[0].headroom
        body.append(
            f"<h2>Which meshes fit in {_esc(fmt_bytes(mem))} per device</h2>"
            f"<p>keeping {head:.0%} for the allocator and the runtime</p>"
        )
        rows = []
        for e in fit_rows:
            best = e.values("simulated") or e.values("estimated") or e.values("measured")
            ok = e.fits()
            rows.append(
                [
                    _esc(e.mesh),
                    _esc(fmt_bytes(best["peak"])),
                    f'<span class="{"yes" if ok else "no"}">{"yes" if ok else "no"}</span>',
                    _esc(e.remedy),
                ]
            )
        body.append(_table(["mesh", "total per rank", "fits", "what would fit"], rows, "fit"))
        body.append(
            svg_grouped_bars(
                "total per rank by mesh",
                [(e.mesh, [(s, e.values(s)["peak"]) for s in e.sources()]) for e in rep.entries],
            )
        )
    for e in rep.entries:
        srcs = e.sources()
        body.append(f"<h2>Mesh {_esc(e.mesh)}</h2>")
        ref_src = e.reference()
        ref = e.values(ref_src) if ref_src else None
        rows = []
        for cat in CATEGORIES:
            cells = [_esc(LABELS[cat])]
            for s in srcs:
                v = e.values(s)[cat]
                diff = _diff(v, ref[cat]) if ref is not None and s != ref_src else ""
                cells.append(_esc(fmt_bytes(v) + diff))
            rows.append(cells)
        body.append(_table(["category (rank 0)", *srcs], rows, "categories"))
        body.append(
            svg_grouped_bars(
                f"mesh {e.mesh}, rank 0: bytes by category",
                [(LABELS[c], [(s, e.values(s)[c]) for s in srcs]) for c in CATEGORIES],
            )
        )
        per_rank = []
        marks = {}
        if e.measured:
            for m in sorted(e.measured, key=lambda m: m["rank"]):
                per_rank.append((str(m["rank"]), m.get("peak_breakdown") or {}))
            src = "measured"
        elif e.estimate_per_rank:
            for est in e.estimate_per_rank:
                phase = est["phases"][est["peak_phase"]]
                per_rank.append((str(est["rank"]), phase))
            src = "estimated"
        if per_rank:
            for est in e.estimate_per_rank:
                marks[str(est["rank"])] = est["peak"]
            per_rank, marks = group_identical_ranks(per_rank, marks)
            body.append(
                svg_stacked_bars(
                    f"mesh {e.mesh}: {src} peak per rank, by category", per_rank, marks or None
                )
            )
        notes = []
        if e.estimate:
            est = e.estimate
            notes.append(
                f"estimated peak at {est['peak_phase']}; micro batch {est['micro_batch']} x "
                f"{est['micro_batches']}, sequence {est['seq_len']}"
            )
        if e.simulated:
            s = e.simulated
            notes.append(
                f"simulated rank {s['rank']} of {s['world_size']} ({s['mixed_precision']}, "
                f"micro batch {s['micro_batch']}): {s['wall_s']:.0f} s, peak RSS "
                f"{fmt_bytes(s['rss_peak'])}"
            )
        if notes:
            body.append("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    if rep.notes:
        body.append("<h2>Notes</h2><ul>")
        body += [f"<li>{_esc(n)}</li>" for n in rep.notes]
        body.append("</ul>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8"/>\n'
        f"<title>{_esc(rep.title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def group_identical_ranks(
    per_rank: list[tuple[str, dict]], marks: dict[str, float]
) -> tuple[list[tuple[str, dict]], dict[str, float]]:
    """One bar per distinct (breakdown, mark): on a large mesh most ranks are identical (they
    differ only by FSDP's padding on the last shards), so hundreds of bars become a few,
    labelled with their ranks and count ("0-62 (x63)")."""
    groups: dict[tuple, list[str]] = {}
    for rank, parts in per_rank:
        key = (tuple(sorted(parts.items())), marks.get(rank))
        groups.setdefault(key, []).append(rank)
    if len(groups) == len(per_rank):
        return per_rank, marks
    bars, new_marks = [], {}
    for (parts, mark), ranks in groups.items():
        label = _rank_label(ranks)
        bars.append((label, dict(parts)))
        if mark is not None:
            new_marks[label] = mark
    return bars, new_marks


def _rank_label(ranks: list[str]) -> str:
    if len(ranks) == 1:
        return ranks[0]
    nums = [int(r) for r in ranks]
    span = (
        f"{nums[0]}-{nums[-1]}"
        if nums == list(range(nums[0], nums[-1] + 1))
        else (f"{nums[0]}, {nums[1]}, ...")
    )
    return f"{span} (x{len(ranks)})"


def write(rep: Report, out: str) -> tuple[str, str]:
    """Write `out`/memory_report.{md,html} (or `out`.md/.html when `out` names a file)."""
    if out.endswith((".md", ".html")):
        base = out.rsplit(".", 1)[0]
    else:
        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, "memory_report")
    if os.path.dirname(base):
        os.makedirs(os.path.dirname(base), exist_ok=True)
    md, page = base + ".md", base + ".html"
    with open(md, "w") as f:
        f.write(markdown(rep))
    with open(page, "w") as f:
        f.write(html_page(rep))
    return md, page
