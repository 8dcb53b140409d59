"""Small inline-SVG charts for the diff page (parity/report/html.py): the loss of both sides per
step (and each rank's), the divergent parameters per step, and the bucketing summary
(parity/diff/bucket_summary.py) of A and B side by side.

Why hand-made SVG: the page must stay one self-contained file without scripts (it is opened from
CI artifacts, offline), and these charts are a few lines and bars. Every SVG scales to the page
width (viewBox, width 100%); exact values are in the tooltips (``<title>``) and in the tables
the page already has. Every piece of text goes through ``html.escape``.
"""

from __future__ import annotations

import html
import math

from parity.diff.bucket_summary import pair_rows, side_label
from parity.diff.magnitude import rel_text, ulps_text
from parity.report.bucket_summary import REGATHER_NOTE, regather

W = 1000  # SVG user units
A_COLOUR, B_COLOUR, DIFF_COLOUR = "#2f6db5", "#e08a1e", "#d0392b"
GRAD_COLOUR = "#8e44ad"


def _e(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _svg(height: float, parts: list[str], label: str) -> str:
    return (f'<svg class="chart" viewBox="-4 -4 {W + 8} {height + 8}" role="img" '
            f'preserveAspectRatio="xMinYMin meet" aria-label="{_e(label)}" '
            f'style="width:100%;height:auto;max-width:1000px;display:block">{"".join(parts)}</svg>')


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None


def _fmt(v: float) -> str:
    return f"{v:.6g}"


# ------------------------------------------------------------------------------------ loss


def loss_svg(loss: dict, ranks: list[int]) -> str:
    """The loss per step: A solid, B dashed (the lowest compared rank), each rank's own value as a
    thin line, and a red ring on every step whose loss differs on some rank. "" without data."""
    steps = [s for s in loss.get("steps") or [] if isinstance(s, dict)]
    series: list[tuple[str, list[tuple[int, float]], str, str]] = []  # name, points, colour, style

    def points(key, idx=None):
        out = []
        for s in steps:
            v = s.get(key) if idx is None else (s.get(key) or [None] * (idx + 1))[idx] \
                if idx < len(s.get(key) or []) else None
            v = _num(v)
            if v is not None and isinstance(s.get("step"), int):
                out.append((s["step"], v))
        return out

    n_ranks = max((len(s.get("a_ranks") or []) for s in steps), default=0)
    if n_ranks > 1:
        for i in range(n_ranks):
            r = ranks[i] if i < len(ranks) else i
            series.append((f"A rank {r}", points("a_ranks", i), A_COLOUR, "thin"))
            series.append((f"B rank {r}", points("b_ranks", i), B_COLOUR, "thin-dash"))
    series.append(("A", points("a"), A_COLOUR, "solid"))
    series.append(("B", points("b"), B_COLOUR, "dash"))
    values = [v for _, pts, _, _ in series for _, v in pts]
    xs = sorted({x for _, pts, _, _ in series for x, _ in pts})
    if not values or not xs:
        return ""
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    left, right, top, h = 90, 20, 18, 200
    x0, x1 = xs[0], xs[-1]

    def px(x):
        return left + (W - left - right) * ((x - x0) / (x1 - x0) if x1 != x0 else 0.5)

    def py(v):
        return top + h * (1 - (v - lo) / (hi - lo))

    parts = [f'<line x1="{left}" y1="{top + h}" x2="{W - right}" y2="{top + h}" stroke="#999"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#999"/>',
             f'<text x="{left - 6}" y="{top + 4}" font-size="11" text-anchor="end">{_e(_fmt(hi))}</text>',
             f'<text x="{left - 6}" y="{top + h}" font-size="11" text-anchor="end">{_e(_fmt(lo))}</text>']
    for x in xs:
        parts.append(f'<text x="{px(x):.1f}" y="{top + h + 16}" font-size="11" '
                     f'text-anchor="middle">{_e(x)}</text>')
    style = {"solid": ' stroke-width="2.5"', "dash": ' stroke-width="2.5" stroke-dasharray="7 5"',
             "thin": ' stroke-width="1" stroke-opacity="0.45"',
             "thin-dash": ' stroke-width="1" stroke-opacity="0.45" stroke-dasharray="3 3"'}
    for name, pts, colour, st in series:
        if not pts:
            continue
        path = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in pts)
        cls = "loss-line" if st in ("solid", "dash") else "loss-rank"
        parts.append(f'<polyline class="{cls}" data-side="{_e(name)}" points="{path}" fill="none" '
                     f'stroke="{colour}"{style[st]}><title>{_e(name)}</title></polyline>')
        if st in ("solid", "dash"):
            for x, v in pts:
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3" fill="{colour}">'
                             f'<title>{_e(name)} step {x}: {_e(repr(v))}</title></circle>')
    for s in steps:
        if s.get("equal") is False and isinstance(s.get("step"), int):
            v = _num(s.get("b")) if _num(s.get("b")) is not None else _num(s.get("a"))
            if v is not None:
                parts.append(f'<circle class="loss-differs" cx="{px(s["step"]):.1f}" cy="{py(v):.1f}" '
                             f'r="7" fill="none" stroke="{DIFF_COLOUR}" stroke-width="2">'
                             f'<title>step {s["step"]}: the loss differs on '
                             f'{_e(s.get("ranks_differing"))} rank(s)</title></circle>')
    legend = [("A (reference)", A_COLOUR, ""), ("B (candidate)", B_COLOUR, ' stroke-dasharray="7 5"')]
    lx = left
    for text, colour, dash in legend:
        parts.append(f'<line x1="{lx}" y1="{top + h + 34}" x2="{lx + 28}" y2="{top + h + 34}" '
                     f'stroke="{colour}" stroke-width="2.5"{dash}/><text x="{lx + 34}" '
                     f'y="{top + h + 38}" font-size="12">{_e(text)}</text>')
        lx += 170
    note = "thin lines: each rank's own loss" if n_ranks > 1 else ""
    note += ("; " if note else "") + "red ring: the loss differs on some rank"
    parts.append(f'<text x="{lx}" y="{top + h + 38}" font-size="11" fill="#555">{_e(note)}</text>')
    return _svg(top + h + 46, parts, "loss per step")


# ------------------------------------------------------------------------- divergent per step


def divergent_svg(d: dict) -> str:
    """Bars per compared step: parameters (red) and gradients (purple) whose hash differs on
    some rank. Steps before the first divergent step are 0; a count the diff did not drill is
    drawn as a grey "?" bar. "" when nothing diverges."""
    steps = [s for s in d.get("steps_compared") or [] if isinstance(s, int)]
    first = d.get("first_divergent_step")
    per = {p.get("step"): p for p in d.get("per_step") or [] if isinstance(p, dict)}
    if not steps or first is None:
        return ""
    rows = []
    for s in steps:
        p = per.get(s) or {}
        if s < first:
            rows.append((s, 0, 0))
        else:
            rows.append((s, p.get("params"), p.get("grads")))
    known = [v for _, a, b in rows for v in (a, b) if isinstance(v, int)]
    top_v = max(known + [1])
    left, top, h = 60, 14, 140
    slot = (W - left - 10) / len(rows)
    bw = min(36.0, slot / 2.6)
    parts = [f'<line x1="{left}" y1="{top + h}" x2="{W - 10}" y2="{top + h}" stroke="#999"/>',
             f'<text x="{left - 6}" y="{top + 4}" font-size="11" text-anchor="end">{top_v}</text>',
             f'<text x="{left - 6}" y="{top + h}" font-size="11" text-anchor="end">0</text>']
    for i, (s, np_, ng) in enumerate(rows):
        cx = left + slot * (i + 0.5)
        for k, (v, colour, what) in enumerate(((np_, DIFF_COLOUR, "parameters"),
                                               (ng, GRAD_COLOUR, "gradients"))):
            x = cx - bw + k * bw
            if isinstance(v, int):
                bh = h * v / top_v
                parts.append(f'<rect class="div-bar" x="{x:.1f}" y="{top + h - bh:.1f}" '
                             f'width="{bw - 2:.1f}" height="{bh:.1f}" fill="{colour}">'
                             f'<title>step {s}: {v} {what} differ</title></rect>')
                if v:
                    parts.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{top + h - bh - 3:.1f}" '
                                 f'font-size="10" text-anchor="middle">{v}</text>')
            else:
                parts.append(f'<rect x="{x:.1f}" y="{top}" width="{bw - 2:.1f}" height="{h}" '
                             f'fill="#ddd"><title>step {s}: {what} not counted (past the drilled '
                             f'steps)</title></rect><text x="{x + bw / 2 - 1:.1f}" '
                             f'y="{top + h / 2}" font-size="11" text-anchor="middle">?</text>')
        parts.append(f'<text x="{cx:.1f}" y="{top + h + 15}" font-size="11" '
                     f'text-anchor="middle">{s}</text>')
    parts.append(f'<rect x="{left}" y="{top + h + 26}" width="12" height="12" fill="{DIFF_COLOUR}"/>'
                 f'<text x="{left + 18}" y="{top + h + 36}" font-size="12">parameters</text>'
                 f'<rect x="{left + 120}" y="{top + h + 26}" width="12" height="12" '
                 f'fill="{GRAD_COLOUR}"/><text x="{left + 138}" y="{top + h + 36}" '
                 f'font-size="12">gradients</text>')
    return _svg(top + h + 42, parts, "divergent parameters per step")


# ------------------------------------------------------------------------------ bucketing


def _count_text(row: dict | None) -> str:
    if row is None:
        return "none"
    before = row.get("count_before")
    return (f"{before} -> {row.get('count_after')}" if isinstance(before, int)
            else str(row.get("count_after")))


def bucketing_svg(a: dict | None, b: dict | None) -> str:
    """Per collective and phase: the buckets of A and of B as two bars on one byte scale (a
    segment per bucket, its width its size), with the counts before -> after, the max span and
    the max compute between reduce-scatters beside them; a figure that differs is red. "" when
    neither side has a summary."""
    pairs = pair_rows(a, b)
    if not pairs:
        return ""
    left, bar_w, bar_h, gap = 200, 430, 22, 8
    y = 0.0
    parts = []
    any_regather = False
    for pair in pairs:
        ra, rb = pair["a"], pair["b"]
        harmless = regather(pair)  # FSDP2's backward re-gathers: copies, shown, never red
        totals = [sum(r.get("sizes") or []) for r in (ra, rb) if r]
        scale = bar_w / max(totals + [1])
        title = f"{pair['collective']} ({pair['phase']})"
        parts.append(f'<text x="0" y="{y + 14:.1f}" font-size="13" font-weight="600">{_e(title)}</text>')
        y += 22
        figs = {}
        for side, r in (("A", ra), ("B", rb)):
            figs[side] = (_count_text(r), None if r is None else r.get("max_span"),
                          None if r is None else r.get("max_consec_compute_between_rs"))
        for side, r, colour in (("A", ra, A_COLOUR), ("B", rb, B_COLOUR)):
            parts.append(f'<text x="0" y="{y + 15:.1f}" font-size="12">{side}: '
                         f'{_e(side_label(r))}</text>')
            x = float(left)
            sizes = (r or {}).get("sizes") or []
            spans = (r or {}).get("spans") or []
            for i, size in enumerate(sizes):
                w = max(2.0, size * scale)
                span = spans[i] if i < len(spans) else None
                tip = (f"{side} bucket {i}: {size:,} bytes"
                       + (f", span {span} nodes in the pre-pass graph" if span is not None else ""))
                parts.append(f'<rect class="bucket-seg" data-side="{side}" x="{x:.1f}" y="{y:.1f}" '
                             f'width="{w:.1f}" height="{bar_h}" fill="{colour}" '
                             f'fill-opacity="{0.55 + 0.45 * (i % 2)}" stroke="#fff">'
                             f'<title>{_e(tip)}</title></rect>')
                if w > 70:
                    parts.append(f'<text x="{x + 4:.1f}" y="{y + 15:.1f}" font-size="10.5" '
                                 f'fill="#fff" pointer-events="none">{size:,} B</text>')
                x += w
            other = figs["B" if side == "A" else "A"]
            mine = figs[side]
            texts = [f"count {mine[0]}", f"max span {'-' if mine[1] is None else mine[1]}"]
            if pair["collective"] == "reduce_scatter":
                texts.append(f"max compute btw RS {'-' if mine[2] is None else mine[2]}")
            for k, (t, tx) in enumerate(zip(texts, (12, 105, 195))):
                # a count that differs is a finding; a span or gap only when both sides know it
                red = mine[k] != other[k] and (k == 0 or None not in (mine[k], other[k]))
                if red and harmless:
                    any_regather = True
                    parts.append(f'<text class="regather" x="{left + bar_w + tx}" '
                                 f'y="{y + 15:.1f}" font-size="11.5" fill="#777">{_e(t)}'
                                 f'<title>{_e(REGATHER_NOTE)}</title></text>')
                    continue
                mark = f' fill="{DIFF_COLOUR}" font-weight="600"' if red else ""
                parts.append(f'<text x="{left + bar_w + tx}" y="{y + 15:.1f}" font-size="11.5"'
                             f'{mark}>{_e(t)}</text>')
            y += bar_h + gap
        y += 10
    parts.append(f'<text x="0" y="{y + 8:.1f}" font-size="11" fill="#555">one segment per bucket, '
                 f'width by bytes (one scale per collective); red: differs between A and B</text>')
    if any_regather:
        y += 16
        parts.append(f'<text x="0" y="{y + 8:.1f}" font-size="11" fill="#777">grey: '
                     f'{_e(REGATHER_NOTE)}</text>')
    return _svg(y + 14, parts, "bucketing summary")


# ------------------------------------------------------------------ size of the difference


def size_svg(d: dict) -> str:
    """How the size of the difference grows over the steps: the relative difference (at least,
    from the per-tensor figures) per step on a log scale, one thin line per divergent parameter
    of the first divergent step (at most 8) and a thick line for the largest over every
    parameter and gradient of the first divergent rank. "" without figures."""
    m = d.get("magnitude") if isinstance(d.get("magnitude"), dict) else {}
    if not m.get("recorded"):
        return ""
    envelope = []
    for s in m.get("per_step") or []:
        best = max((_num((s.get(k) or {}).get("rel")) or 0.0 for k in ("param", "grad")),
                   default=0.0)
        if isinstance(s.get("step"), int):
            envelope.append((s["step"], best))
    series = []
    for p in (m.get("params") or [])[:8]:
        pts = [(x["step"], _num(x.get("rel"))) for x in p.get("steps") or []
               if isinstance(x.get("step"), int) and _num(x.get("rel")) is not None]
        if pts:
            series.append((f"{p.get('fqn')} ({p.get('kind')}, rank {p.get('rank')})", pts))
    values = [v for _, v in envelope if v > 0] + [v for _, pts in series for _, v in pts if v > 0]
    xs = sorted({x for x, _ in envelope} | {x for _, pts in series for x, _ in pts})
    if not values or not xs:
        return ""
    lo = math.floor(math.log10(min(values)))
    hi = math.ceil(math.log10(max(values)))
    hi = hi if hi > lo else lo + 1
    floor_v = 10.0 ** lo
    left, right, top, h = 90, 20, 14, 190
    x0, x1 = xs[0], xs[-1]

    def px(x):
        return left + (W - left - right) * ((x - x0) / (x1 - x0) if x1 != x0 else 0.5)

    def py(v):
        v = max(v, floor_v)  # 0 (the figures agree) drawn on the floor
        return top + h * (1 - (math.log10(v) - lo) / (hi - lo))

    parts = [f'<line x1="{left}" y1="{top + h}" x2="{W - right}" y2="{top + h}" stroke="#999"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#999"/>']
    for e in range(lo, hi + 1):
        yy = py(10.0 ** e)
        parts.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{W - right}" y2="{yy:.1f}" '
                     f'stroke="#eee"/><text x="{left - 6}" y="{yy + 4:.1f}" font-size="11" '
                     f'text-anchor="end">1e{e}</text>')
    for x in xs:
        parts.append(f'<text x="{px(x):.1f}" y="{top + h + 16}" font-size="11" '
                     f'text-anchor="middle">{_e(x)}</text>')
    for k, (name, pts) in enumerate(series):
        colour = f"hsl({(k * 47) % 360},55%,50%)"
        path = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in pts)
        parts.append(f'<polyline class="size-param" points="{path}" fill="none" stroke="{colour}" '
                     f'stroke-width="1.2" stroke-opacity="0.8"><title>{_e(name)}</title></polyline>')
        for x, v in pts:
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="2.5" fill="{colour}">'
                         f'<title>{_e(name)} step {x}: relative difference >= {rel_text(v)}'
                         f'</title></circle>')
    if envelope:
        path = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in envelope)
        parts.append(f'<polyline class="size-max" points="{path}" fill="none" '
                     f'stroke="{DIFF_COLOUR}" stroke-width="2.5"><title>largest over every '
                     f'parameter and gradient</title></polyline>')
        for x, v in envelope:
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3.5" fill="{DIFF_COLOUR}">'
                         f'<title>step {x}: largest relative difference >= {rel_text(v)}</title>'
                         f'</circle>')
    parts.append(f'<line x1="{left}" y1="{top + h + 32}" x2="{left + 28}" y2="{top + h + 32}" '
                 f'stroke="{DIFF_COLOUR}" stroke-width="2.5"/><text x="{left + 34}" '
                 f'y="{top + h + 36}" font-size="12">largest over every parameter and gradient'
                 f'</text><text x="{left + 330}" y="{top + h + 36}" font-size="11" fill="#555">'
                 'thin lines: the parameters that differed first; relative difference, log scale; '
                 '0 drawn on the floor</text>')
    return _svg(top + h + 44, parts, "size of the difference per step")


def size_section(d: dict) -> str:
    """The diff page's section on the size of the differences: the chart and a per-step table,
    said to be summaries (docs/diff.md)."""
    m = d.get("magnitude") if isinstance(d.get("magnitude"), dict) else {}
    if not m:
        return ""
    if not m.get("recorded"):
        return ("<h2>Size of the difference</h2><p class=muted>Not shown: the runs carry no "
                "per-tensor figures (recorded before parity kept them, or by another hasher)."
                "</p>")
    rows = []
    for s in m.get("per_step") or []:
        cells = [f"<td>{_e(s.get('step'))}</td>"]
        for kind in ("param", "grad"):
            k = s.get(kind)
            if not isinstance(k, dict):
                cells.append("<td colspan=4 class=muted>not recorded</td>")
                continue
            nonfinite = f" ({k['nonfinite']} NaN/inf)" if k.get("nonfinite") else ""
            cells.append(f"<td>{_e(k.get('differ'))}{_e(nonfinite)}</td>"
                         f"<td>{_e(rel_text(k.get('rel')))}</td>"
                         f"<td>{_e(ulps_text(k.get('ulps')))}</td>"
                         f"<td class=mono>{_e(k.get('fqn') or '')}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    rank = (m.get("per_step") or [{}])[0].get("rank")
    return ("<h2>Size of the difference</h2>"
            f"<p class=muted>Per step on rank {_e(rank)}, from figures capture keeps next to "
            f"each hash: {_e(m.get('note'))}. The relative difference is a lower bound on "
            "||B - A|| / ||A||; ulps are that bound in units of the last bit of a typical "
            "element (about 1: a last-bit difference; thousands: drift).</p>"
            + size_svg(d)
            + "<div class=wide><table><tr><th rowspan=2>step</th><th colspan=4>parameters</th>"
            "<th colspan=4>gradients</th></tr><tr><th>differ</th><th>rel &gt;=</th><th>ulps</th>"
            "<th>largest</th><th>differ</th><th>rel &gt;=</th><th>ulps</th><th>largest</th></tr>"
            + "".join(rows) + "</table></div>")


def attribution_html(a: dict | None, b: dict | None) -> str:
    """The parameters issued under a module that is not their owner, per side (a table)."""
    rows = []
    for side, s in (("A", a), ("B", b)):
        for x in (s or {}).get("attribution") or []:
            rows.append(f"<tr><td>{side}</td><td class=mono>{_e(x.get('fqn'))}</td>"
                        f"<td>{_e(x.get('collective'))}</td><td>{_e(x.get('graph') or x.get('source'))}</td>"
                        f"<td class=mono>{_e(x.get('module'))}</td>"
                        f"<td class=mono>{_e(x.get('owner') or '(root)')}</td></tr>")
    if not rows:
        return ("<p class=muted>Every recorded payload was issued under its parameter's own module "
                "(or an FSDP group holding it).</p>")
    return ("<p>Payloads issued under a module that is not their parameter's owner:</p>"
            "<div class=wide><table><tr><th>side</th><th>parameter</th><th>collective</th>"
            "<th>graph</th><th>issued under</th><th>owner</th></tr>" + "".join(rows[:200])
            + "</table></div>")


def bucketing_section(d: dict) -> str:
    """The diff page's bucketing section: headlines, the chart, the attribution table."""
    bk = d.get("bucketing") if isinstance(d.get("bucketing"), dict) else {}
    a, b = bk.get("a"), bk.get("b")
    if not (a and a.get("graphs")) and not (b and b.get("graphs")):
        return ""
    heads = (f"<p>A <code>{_e((a or {}).get('headline') or 'no buckets recorded')}</code> &nbsp; B "
             f"<code>{_e((b or {}).get('headline') or 'no buckets recorded')}</code> <span class=muted>"
             "collectives before -> after the passes (docs/inspect.md)</span></p>")
    return ("<h2>Bucketing, A vs B</h2>" + heads + bucketing_svg(a, b) + attribution_html(a, b)
            + moved_html(bk.get("moved") or []))


def moved_html(moved: list[dict]) -> str:
    """Parameters whose payload another module's bucket carries in B than in A."""
    if not moved:
        return ""
    rows = "".join(
        f"<tr><td>{_e(m.get('collective'))}</td><td class=mono>{_e(m.get('a_module') or '(root)')}"
        f"</td><td class=mono>{_e(m.get('b_module') or '(root)')}</td><td>{len(m.get('fqns') or [])}"
        f"</td><td class=mono>{_e(', '.join((m.get('fqns') or [])[:6]))}"
        f"{' ...' if len(m.get('fqns') or []) > 6 else ''}</td></tr>" for m in moved[:100])
    return ("<p>Parameters carried by another module's bucket in B than in A:</p><div class=wide>"
            "<table><tr><th>collective</th><th>bucket of (A)</th><th>bucket of (B)</th><th>n</th>"
            "<th>parameters</th></tr>" + rows + "</table></div>")
