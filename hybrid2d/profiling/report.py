"""The memory report: measured, estimated and simulated figures side by side, as Markdown and as
one self-contained HTML page (inline SVG charts and CSS, no scripts, no external files).

A report is a list of entries, one per mesh. Each entry may hold any of: the analytic estimate
(`estimate.Estimate.to_dict()`, for rank 0 and optionally every rank), the simulated rank
(`simulate.simulate` result) and the measured ranks of a real run (`measure.StepMemory` dicts,
one per rank). Missing sources are left out of the tables and charts. Both formats render the
same blocks (`_blocks`), so they always say the same; only HTML draws the charts.
"""

from __future__ import annotations

import html
import os
import pathlib
from dataclasses import dataclass, field

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "peak")
LABELS = {c: c for c in CATEGORIES} | {
    "optimizer": "optimizer state",
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

    def best(self) -> dict[str, int] | None:
        """The figures a verdict uses: the simulation, else the estimate, else the measurement."""
        return self.values("simulated") or self.values("estimated") or self.values("measured")

    def usable(self) -> float | None:
        """Bytes of the device a rank may use (its memory less the headroom), when given."""
        return None if self.device_memory is None else self.device_memory * (1 - self.headroom)

    def fits(self) -> bool | None:
        if self.device_memory is None:
            return None
        return self.best()["peak"] <= self.usable()

    def notes(self) -> list[str]:
        """What the estimate and the simulation say besides the figures, one line each."""
        out = []
        if est := self.estimate:
            out.append(
                f"estimated peak at: {est['peak_phase']}; micro batch {est['micro_batch']} x "
                f"{est['micro_batches']} per step, sequence {est['seq_len']}"
            )
        if s := self.simulated:
            step = f" (step {s['step_s']:.0f} s)" if "step_s" in s else ""
            out.append(
                f"simulated rank {s['rank']} of {s['world_size']} ({s['mixed_precision']}, "
                f"micro batch {s['micro_batch']}): peak in {s['memory']['peak_phase']}, "
                f"{s['wall_s']:.0f} s{step}, process peak RSS {fmt_bytes(s['rss_peak'])}"
            )
        return out


@dataclass
class Report:
    title: str
    summary: list[tuple[str, str]] = field(default_factory=list)  # (setting, value)
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _cell(n: int, ref: int | None) -> str:
    """`n` bytes, and how far from the reference source's figure when there is one."""
    return fmt_bytes(n) + (f" ({100 * (n - ref) / ref:+.1f}%)" if ref else "")


def _blocks(rep: Report) -> list[tuple]:
    """The report as ("h1" | "h2" | "p", text), ("table", header, rows, css class), ("ul",
    items) and ("chart", svg) blocks, in order."""
    out: list[tuple] = [("h1", rep.title)]
    if rep.summary:
        out.append(("table", ["setting", "value"], rep.summary, ""))
    fit = [e for e in rep.entries if e.fits() is not None]
    if fit:
        rows = [
            [e.mesh, fmt_bytes(e.best()["peak"]), "yes" if e.fits() else "no", e.remedy]
            for e in fit
        ]
        totals = [(e.mesh, [(s, e.values(s)["peak"]) for s in e.sources()]) for e in rep.entries]
        out += [
            ("h2", f"Which meshes fit in {fmt_bytes(fit[0].device_memory)} per device"),
            ("p", f"keeping {fit[0].headroom:.0%} for the allocator and the runtime"),
            ("table", ["mesh", "total per rank", "fits", "what would fit"], rows, "fit"),
            ("chart", svg_grouped_bars("total per rank by mesh", totals, _limit(fit[0]))),
        ]
    for e in rep.entries:
        vals = {s: e.values(s) for s in e.sources()}
        ref = vals.get(e.reference()) or {}
        rows = [
            [LABELS[c], *(_cell(v[c], None if v is ref else ref.get(c)) for v in vals.values())]
            for c in CATEGORIES
        ]
        by_category = [(LABELS[c], [(s, v[c]) for s, v in vals.items()]) for c in CATEGORIES]
        out += [
            ("h2", f"Mesh {e.mesh}"),
            ("table", ["category (rank 0)", *vals], rows, "categories"),
            (
                "chart",
                svg_grouped_bars(
                    f"mesh {e.mesh}, rank 0: bytes by category", by_category, _limit(e)
                ),
            ),
        ]
        out += [("chart", c) for c in [_per_rank_chart(e)] if c]
        if e.measured:
            ranks = sorted(e.measured, key=lambda m: m["rank"])
            rows = [
                [str(m["rank"]), *(fmt_bytes(m[c]) for c in CATEGORIES), fmt_bytes(m.get("rss"))]
                for m in ranks
            ]
            out.append(("table", ["rank", *(LABELS[c] for c in CATEGORIES), "RSS"], rows, ""))
        if e.notes():
            out.append(("ul", e.notes()))
    if rep.notes:
        out += [("h2", "Notes"), ("ul", rep.notes)]
    return out


def markdown(rep: Report) -> str:
    out = []
    for kind, *args in _blocks(rep):
        if kind == "table":
            header, rows, _ = args
            out += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
            out += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        elif kind == "ul":
            out += [f"- {item}" for item in args[0]]
        elif kind != "chart":
            out.append({"h1": "# ", "h2": "## ", "p": ""}[kind] + args[0])
        if kind != "chart":
            out.append("")
    return "\n".join(out)


# ---- HTML with inline SVG ------------------------------------------------------------------


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _svg(title: str, width: float, height: float, parts: list[str]) -> str:
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
            f'height="{height}" role="img" aria-label="{_esc(title)}">',
            f"<title>{_esc(title)}</title>",
            f'<text x="4" y="16" class="ct">{_esc(title)}</text>',
            *parts,
            "</svg>",
        ]
    )


def _legend(items: list[tuple[str, str]], x: int, y: int) -> tuple[list[str], int]:
    """A box of each (label, colour) and its label, left to right from x; and where it ended."""
    parts = []
    for label, color in items:
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{x + 14}" y="{y}">{_esc(label)}</text>')
        x += 28 + 7 * len(label)
    return parts, x


def _limit(e: Entry) -> tuple[str, float] | None:
    """The line the bar charts draw at the device's usable memory, when it is known."""
    if e.usable() is None:
        return None
    return f"usable: {fmt_bytes(e.usable())} of {fmt_bytes(e.device_memory)}", e.usable()


def _limit_line(limit, x1, y1, x2, y2) -> list[str]:
    label, value = limit
    return [
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="#b00" '
        f'stroke-width="2" stroke-dasharray="6,3" class="usable"><title>{_esc(label)}</title>'
        "</line>"
    ]


def svg_grouped_bars(
    title: str,
    groups: list[tuple[str, list[tuple[str, float]]]],
    limit: tuple[str, float] | None = None,
) -> str:
    """Horizontal bars: one group per label, one bar per (series, value); `limit` (label,
    bytes) draws a dashed line across the groups at that value (the usable device memory)."""
    bar, gap, left, width = 14, 10, 170, 460
    vmax = max([v for _, bars in groups for _, v in bars] + [limit[1] if limit else 0]) or 1
    rows = sum(len(b) for _, b in groups)
    height = 40 + rows * bar + len(groups) * gap + 30
    series = list(dict.fromkeys(s for _, bars in groups for s, _ in bars))
    parts = []
    y = 30
    for label, bars in groups:
        parts.append(
            f'<text x="{left - 6}" y="{y + bar * len(bars) / 2 + 4:.0f}" text-anchor="end">'
            f"{_esc(label)}</text>"
        )
        for s, v in bars:
            w = max(1.0, width * v / vmax)
            parts += [
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 2}" '
                f'fill="{COLORS.get(s, "#888")}"><title>{_esc(s)}: {_esc(fmt_bytes(v))}</title>'
                "</rect>",
                f'<text x="{left + w + 4:.1f}" y="{y + bar - 4}" class="v">{_esc(fmt_bytes(v))}'
                "</text>",
            ]
            y += bar
        y += gap
    legend, x = _legend([(s, COLORS.get(s, "#888")) for s in series], left, height - 9)
    parts += legend
    if limit:
        lx = left + width * limit[1] / vmax
        parts += _limit_line(limit, lx, 24, lx, y - gap + 2)
        parts += _limit_line(limit, x, height - 13, x + 16, height - 13)
        parts.append(f'<text x="{x + 20}" y="{height - 9}">{_esc(limit[0])}</text>')
        x += 30 + 7 * len(limit[0])
    return _svg(title, max(left + width + 120, x), height, parts)


def svg_stacked_bars(
    title: str,
    bars: list[tuple[str, dict[str, float]]],
    marks: dict[str, float] | None = None,
    limit: tuple[str, float] | None = None,
) -> str:
    """Vertical stacked bars (one per rank) by category; `marks` draws a tick per bar label,
    `limit` (label, bytes) a dashed line across the bars (the usable device memory)."""
    n = max(1, len(bars))
    bw = max(6, min(40, 560 // n))
    left, top, plot_h = 80, 30, 220
    extra = [limit[1]] if limit else []
    vmax = max([sum(v.values()) for _, v in bars] + list((marks or {}).values()) + extra + [1])
    width = left + n * (bw + 4) + 20
    height = top + plot_h + 60
    parts = [
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
    legend, x = _legend([(LABELS[c], COLORS[c]) for c in STACKED], left, height - 13)
    parts += legend
    if marks:
        parts += [
            f'<line x1="{x}" y1="{height - 17}" x2="{x + 12}" y2="{height - 17}" '
            f'stroke="{COLORS["estimated"]}" stroke-width="3"/>',
            f'<text x="{x + 16}" y="{height - 13}">estimated peak</text>',
        ]
        x += 130
    if limit:
        ly = top + plot_h - plot_h * limit[1] / vmax
        parts += _limit_line(limit, left, ly, width - 10, ly)
        parts += _limit_line(limit, x, height - 17, x + 16, height - 17)
        parts.append(f'<text x="{x + 20}" y="{height - 13}">{_esc(limit[0])}</text>')
        x += 30 + 7 * len(limit[0])
    return _svg(title, max(width, x + 10), height, parts)


def _per_rank_chart(e: Entry) -> str | None:
    """Each rank's peak by category (measured, else estimated), the estimate's peak marked."""
    if e.measured:
        src = "measured"
        bars = [(str(m["rank"]), m.get("peak_breakdown") or {}) for m in e.measured]
        bars.sort(key=lambda b: int(b[0]))
    else:
        src = "estimated"
        bars = [(str(est["rank"]), est["phases"][est["peak_phase"]]) for est in e.estimate_per_rank]
    if not bars:
        return None
    marks = {str(est["rank"]): est["peak"] for est in e.estimate_per_rank}
    bars, marks = group_identical_ranks(bars, marks)
    title = f"mesh {e.mesh}: {src} peak per rank, by category"
    return svg_stacked_bars(title, bars, marks or None, _limit(e))


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
svg.chart { display: block; margin: 8px 0 16px; font-size: 11px; }
svg.chart .ct { font-size: 13px; font-weight: bold; }
.no { color: #b00; font-weight: bold; } .yes { color: #070; font-weight: bold; }
table.fit td:last-child, table.fit th:last-child { text-align: left; max-width: 560px; }
"""


def _table(header: list[str], rows: list, cls: str = "") -> str:
    """An HTML table of plain-text cells; a fit verdict (yes / no) is coloured by its class."""
    out = [f'<table class="{cls}">' if cls else "<table>", "<tr>"]
    out += [f"<th>{_esc(h)}</th>" for h in header]
    out.append("</tr>")
    for r in rows:
        cells = [
            f'<td class="{c}">{c}</td>' if c in ("yes", "no") else f"<td>{_esc(c)}</td>" for c in r
        ]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def html_page(rep: Report) -> str:
    body = []
    for kind, *args in _blocks(rep):
        if kind == "table":
            body.append(_table(*args))
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{_esc(item)}</li>" for item in args[0]) + "</ul>")
        elif kind == "chart":
            body.append(args[0])
        else:
            body.append(f"<{kind}>{_esc(args[0])}</{kind}>")
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
    contiguous = nums == list(range(nums[0], nums[-1] + 1))
    span = f"{nums[0]}-{nums[-1]}" if contiguous else f"{nums[0]}, {nums[1]}, ..."
    return f"{span} (x{len(ranks)})"


def write(rep: Report, out: str) -> tuple[str, str]:
    """Write `out`/memory_report.{md,html} (or `out`.md/.html when `out` names a file)."""
    named = out.endswith((".md", ".html"))
    base = out.rsplit(".", 1)[0] if named else os.path.join(out, "memory_report")
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    paths = base + ".md", base + ".html"
    for path, text in zip(paths, (markdown(rep), html_page(rep)), strict=True):
        pathlib.Path(path).write_text(text)
    return paths
