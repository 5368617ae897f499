#!/usr/bin/env python3
"""Write bench/throughput.svg: a horizontal bar chart of req/s per scenario.

    chart.py RESULTS_JSON OUT_SVG

RESULTS_JSON is the file bench/report.py writes. Standard library only: the
SVG is written by hand (no matplotlib).
"""

import json
import sys
from xml.sax.saxutils import escape

WIDTH = 820
LABEL_W = 300
VALUE_W = 110
BAR_H = 26
GAP = 10
TOP = 58
BOTTOM = 44


def nice_max(v):
    """A round axis maximum at or above v."""
    if v <= 0:
        return 1
    mag = 10 ** (len(str(int(v))) - 1)
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * mag >= v:
            return m * mag
    return 10 * mag


def fmt(v):
    return f"{v:,.0f}"


def main(src, dst):
    with open(src) as f:
        res = json.load(f)
    rows = [s for s in res["scenarios"] if s.get("rps") is not None]
    vmax = nice_max(max((s["rps"] for s in rows), default=1))
    plot_w = WIDTH - LABEL_W - VALUE_W - 20
    height = TOP + len(rows) * (BAR_H + GAP) + BOTTOM
    meta = res["meta"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="13">',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="16" font-weight="bold">'
        f'Throughput per scenario (req/s, higher is better)</text>',
        f'<text x="{WIDTH / 2}" y="42" text-anchor="middle" font-size="11" fill="#555">'
        f'{escape(meta.get("subtitle", ""))}</text>',
    ]
    x0 = LABEL_W
    # grid lines and axis labels
    for i in range(0, 5):
        v = vmax * i / 4
        x = x0 + plot_w * i / 4
        y_end = TOP + len(rows) * (BAR_H + GAP)
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{y_end}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{y_end + 16}" text-anchor="middle" font-size="11" '
                   f'fill="#555">{fmt(v)}</text>')
    for i, s in enumerate(rows):
        y = TOP + i * (BAR_H + GAP)
        w = plot_w * s["rps"] / vmax
        colour = "#4878a8" if s.get("system") == "fencegate" else "#9a9a9a"
        label = f'({s["id"]}) {s["name"]}'
        out.append(f'<text x="{x0 - 8}" y="{y + BAR_H * 0.68:.1f}" text-anchor="end">{escape(label)}</text>')
        out.append(f'<rect x="{x0}" y="{y}" width="{max(w, 1):.1f}" height="{BAR_H}" fill="{colour}">'
                   f'<title>{escape(label)}: {fmt(s["rps"])} {escape(s.get("unit", "req/s"))}</title></rect>')
        out.append(f'<text x="{x0 + w + 6:.1f}" y="{y + BAR_H * 0.68:.1f}">{fmt(s["rps"])}'
                   f'{" " + escape(s["unit"]) if s.get("unit") and s["unit"] != "req/s" else ""}</text>')
    y_leg = height - 12
    out.append(f'<rect x="{x0}" y="{y_leg - 10}" width="12" height="12" fill="#4878a8"/>'
               f'<text x="{x0 + 18}" y="{y_leg}" font-size="11">fencegate</text>')
    out.append(f'<rect x="{x0 + 110}" y="{y_leg - 10}" width="12" height="12" fill="#9a9a9a"/>'
               f'<text x="{x0 + 128}" y="{y_leg}" font-size="11">reference (nginx, pgbench)</text>')
    out.append("</svg>")
    with open(dst, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
