"""One self-contained HTML file for a sweep or a diff: the verdict, a strip of steps per cell, and
each differing bucket drawn as two bars of parameters (reference above, candidate below).

Why pictures: a bucket-order bug is two rows where the same parameters sit at different
positions, and a sweep verdict is a matrix that stays green until the first divergence. Hand-made
inline SVG keeps the file self-contained (no network, no scripts, no assets) and crisp at any
zoom; every SVG scales to the page width (viewBox, width 100%). A parameter of 128 B in a 100 KB
bucket would be under a pixel at true scale, so the bars give every parameter a minimum width and
share the rest by size (true offsets and sizes are in the tooltips and the table), and every
position whose parameter differs is outlined and marked, not only the first.

The verdict line comes from parity.policy, as on the console; every piece of text goes through
``html.escape`` (parameter names, axis values and paths are user data). The pages read the typed
``DiffResult`` (a sweep cell's diff is typed once, with ``diff.result.from_dict``); the charts
(html_charts.py) and the bucket pictures of every pair (html_reduction.py) read its JSON.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import shlex
import time

from parity.consequences import WORDS
from parity.diff.magnitude import first_sizes, size_texts
from parity.report.html_reduction import (SWEEP_EXTRA_BUCKETS, buckets_html, pair_views,
                                         prediction_html)
from parity import policy
from parity.artifacts import write_text_atomic
from parity.diff.result import DiffResult
from parity.diff.result import from_dict as diff_from_dict
from parity.rundir import META_FILE, rank_dir
from parity.sweep.model import CellResult, SideResult, SweepReport, as_report, got
from parity.sweep.state import axis_names
from parity.report.text import safe_text

STATE_COLOURS = {
    "equal": "#2e9d58", "divergent": "#d0392b", "missing": "#d9d9d9", "failed": "#5b1a1a",
    "skipped": "#b8b8b8",
}
STATUS_COLOURS = {
    "match": "#2e9d58", "hash_mismatch": "#d0392b", "order_mismatch": "#e08a1e",
    "nondeterministic": "#1f8a9e",
    "failed": "#5b1a1a", "skipped": "#8c8c8c", "incomplete": "#5b1a1a",
}
WORD_COLOURS = {"HOLDS": "#2e9d58", "FAILS": "#d0392b", "INCOMPLETE": "#b07100"}
MARK = "#c00"
BAR_WIDTH = 1000  # SVG user units; the SVG itself is as wide as the page
MIN_SEGMENT = 34  # user units: the smallest parameter stays visible and labelled by hover
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
color:#1d1d1f;max-width:1200px;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:18px 0 6px}table{border-collapse:collapse;margin:6px 0}
th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f6f6f6}td.mono{word-break:break-all;max-width:460px}td.loc{white-space:nowrap;font-family:monospace}
code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.badge{color:#fff;border-radius:4px;padding:1px 7px;font-size:12px;white-space:nowrap}
.muted{color:#666}.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
.verdict{font-size:15px;margin:10px 0 14px;padding:8px 12px;border-left:6px solid;
background:#fafafa}.verdict b{font-size:16px}
svg.bars{width:100%;height:auto;display:block;max-width:1200px}
.wide{overflow-x:auto}td.detail{min-width:300px}details{margin:8px 0}summary{cursor:pointer;font-weight:600}
"""


def _e(x) -> str:
    return html.escape(safe_text(x, keep_lines=True), quote=True)


def _value(v) -> str:
    """An axis value as the spec and the console write it (true/false, not True/False)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _colour(fqn: str) -> str:
    """The same parameter gets the same colour on both bars (and in every cell)."""
    h = int.from_bytes(hashlib.blake2b(fqn.encode(), digest_size=4).digest(), "big")
    return f"hsl({h % 360},{55 + h // 360 % 25}%,{62 + h // 9000 % 14}%)"


def _short(fqn: str) -> str:
    parts = fqn.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else fqn


def _verdict_block(v: policy.Verdict) -> str:
    colour = WORD_COLOURS.get(v.word, "#444")
    body = v.body()
    return (f'<div class=verdict style="border-color:{colour}"><b style="color:{colour}">'
            f'{_e(v.head())}</b>{": " + _e(body) if body else ""}</div>')


# ------------------------------------------------------------------------------------- strips


def _step_states(cell: CellResult, diff: DiffResult | None,
                 steps: list[int]) -> list[tuple[str, str]]:
    """(state, tooltip) per step for one cell's strip (``diff``: the cell's, typed)."""
    status = got(cell.status)
    if status == "skipped":
        return [("skipped", f"step {s}: skipped ({cell.reason or ''})") for s in steps]
    compared = set(diff.steps_compared) if diff else set()
    first = diff.first_divergent_step if diff else None
    counts = {count.step: count for count in diff.per_step} if diff else {}
    out = []
    for s in steps:
        if s not in compared:
            state = "failed" if status == "failed" else "missing"
            out.append((state, f"step {s}: not compared ({state})"))
        elif first is not None and s >= first:
            count = counts.get(s)
            n = count.params if count else "?"
            g = count.grads if count else "?"
            out.append(("divergent", f"step {s}: {n} parameters, {g} gradients differ"))
        else:
            out.append(("equal", f"step {s}: bitwise equal"))
    return out


def _strip(cell: CellResult, diff: DiffResult | None, steps: list[int]) -> str:
    w, gap, h = 18, 2, 18
    states = _step_states(cell, diff, steps)
    rects = []
    for i, (state, tip) in enumerate(states):
        fill = STATE_COLOURS[state]
        rects.append(f'<rect x="{i * (w + gap)}" y="0" width="{w}" height="{h}" rx="2" '
                     f'fill="{fill}"><title>{_e(tip)}</title></rect>')
    width = max(1, len(states) * (w + gap))
    return (f'<svg class="strip" width="{width}" height="{h}" viewBox="0 0 {width} {h}" '
            f'role="img" aria-label="steps">{"".join(rects)}</svg>')


def _legend() -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{_e(k)}</span>'
                    for k, c in STATE_COLOURS.items())
    return f'<div class="legend muted">{items}</div>'


# ---------------------------------------------------------------------------------- bucket bars


def segment_widths(sizes: list[int], width: float = BAR_WIDTH,
                   min_w: float = MIN_SEGMENT) -> list[float]:
    """Widths of consecutive segments filling ``width``: each at least ``min_w``, the rest shared
    in proportion to size (so a 128 B norm next to 24 KB matrices is still a visible box)."""
    n = len(sizes)
    if n == 0:
        return []
    min_w = min(min_w, width / n)
    spare = width - n * min_w
    total = sum(max(0, s) for s in sizes) or 1
    return [min_w + spare * max(0, s) / total for s in sizes]


def bucket_svg(fb: dict, ref_label: str = "reference", cand_label: str = "candidate") -> str:
    """Two bars of the bucket's parameters in payload order (A above, B below). Every position
    whose parameter differs between the sides is outlined and marked with a triangle; the first
    one gets a filled triangle. Not to byte scale below ``MIN_SEGMENT`` (see module doc)."""
    rows = fb.get("rows") or []
    first = fb.get("position")
    bar_h, label_h, gap = 34, 28, 24
    height = 2 * (label_h + bar_h) + gap + 40
    parts = []
    totals = {side: sum(int((r.get(side) or {}).get("size") or 0) for r in rows if r.get(side))
              for side in ("a", "b")}
    most = max(totals.values()) or 1
    for k, (side, label) in enumerate((("a", f"A: {ref_label}"), ("b", f"B: {cand_label}"))):
        y0 = k * (label_h + bar_h + gap)
        y = y0 + label_h
        ents = [(r.get("position"), r[side], r.get("same", True)) for r in rows if r.get(side)]
        total = totals[side]
        # the bars share one byte scale: a side holding half the bytes draws half the bar
        bar_w = BAR_WIDTH * total / most if total else BAR_WIDTH
        parts.append(f'<text x="0" y="{y0 + 13}" font-size="13" font-weight="600">{_e(label)}'
                     f'</text><text x="{BAR_WIDTH}" y="{y0 + 13}" font-size="11" fill="#555" '
                     f'text-anchor="end">{len(ents)} parameters, {total:,} bytes</text>')
        x = 0.0
        for (pos, e, same), w in zip(ents, segment_widths([int(e.get("size") or 0)
                                                           for _, e, _ in ents], bar_w)):
            off, size = int(e.get("offset") or 0), int(e.get("size") or 0)
            fqn = str(e.get("fqn"))
            tip = (f"{fqn}\nposition {pos}, offset {off:,} B, size {size:,} B, "
                   f"{e.get('numel', '?')} elements, {e.get('dtype', '?')}"
                   + ("" if same else "\ndiffers from the other side at this position"))
            stroke = (f' stroke="{MARK}" stroke-width="3"' if not same
                      else ' stroke="#fff" stroke-width="1"')
            moved = f' class="moved" data-position="{_e(pos)}"' if not same else ""
            parts.append(f'<rect{moved} x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" '
                         f'fill="{_colour(fqn)}"{stroke}><title>{_e(tip)}</title></rect>')
            if w > 40:
                parts.append(f'<text x="{x + 3:.2f}" y="{y + bar_h / 2 + 4}" font-size="10.5" '
                             f'pointer-events="none">{_e(_short(fqn)[: int(w / 6.2)])}</text>')
            if not same:
                cx = x + w / 2
                fill = MARK if pos == first else "#fff"
                parts.append(f'<path class="marker" d="M{cx:.2f},{y - 1} l-6,-9 h12 z" '
                             f'fill="{fill}" stroke="{MARK}" stroke-width="1.5"/>')
            x += w
    parts.append(f'<text class="legend-line" x="0" y="{height - 20}" font-size="11" fill="#555">'
                 'payload order, left to right; bar lengths by total bytes (one scale for A and B)'
                 f'</text><text class="legend-line" x="0" y="{height - 6}" font-size="11" '
                 f'fill="#555">each parameter\'s box is at least '
                 f'{100 * MIN_SEGMENT / BAR_WIDTH:.1f}% of the bar wide, so small ones stay '
                 'visible; the rest of the width is shared by size (true offsets and sizes: the '
                 'table, the tooltips)</text>')
    return (f'<svg class="bars" viewBox="-2 -2 {BAR_WIDTH + 4} {height + 4}" role="img" '
            f'preserveAspectRatio="xMinYMin meet" aria-label="bucket layout">'
            f'{"".join(parts)}</svg>')


def _fingerprint(fb: dict) -> str:
    """Cells whose first differing bucket is the same finding share one picture."""
    key = {k: fb.get(k) for k in ("collective", "verdict", "index", "b_index", "group", "b_group",
                                  "position")}
    key["rows"] = [[(r.get(s) or {}).get(f) for s in ("a", "b") for f in ("fqn", "offset", "size")]
                   for r in fb.get("rows") or []]
    return hashlib.blake2b(json.dumps(key, sort_keys=True, default=str).encode(),
                           digest_size=8).hexdigest()


def _bucket_section(fb: dict, anchor: str, labels: tuple[str, str], cells: list[CellResult]) -> str:
    a, b = fb.get("a") or {}, fb.get("b") or {}
    head = (f"{_e(fb.get('collective'))} bucket {_e(fb.get('index'))} "
            f"({_e(fb.get('group') or 'root')}) vs candidate bucket {_e(fb.get('b_index'))}: "
            f"{_e(fb.get('verdict'))}")
    if fb.get("consequence") in WORDS:  # issue 20: what it can do to values
        head += f" <small>({_e(WORDS[fb['consequence']])})</small>"
    moved = [r for r in fb.get("rows") or [] if not r.get("same", True)]
    where = ""
    if a or b:
        where = (f"<p>{len(moved)} position(s) differ, first <b>{_e(fb.get('position'))}</b>: A "
                 f"<code>{_e(a.get('fqn'))}</code> @ byte {_e(a.get('offset'))}, B "
                 f"<code>{_e(b.get('fqn'))}</code> @ byte {_e(b.get('offset'))}. "
                 f"<span class=muted>{_e(fb.get('detail'))}</span></p>")
    seen = ""
    if cells and got(cells[0].id) is not None:
        ids = ", ".join(f"<code>{_e(got(cell.id))}</code>" for cell in cells)
        seen = f"<p class=muted>The same finding in {len(cells)} cell(s): {ids}</p>"
    table = ["<div class=wide><table><tr><th>pos</th><th>A parameter</th><th>A offset</th>"
             "<th>B parameter</th><th>B offset</th><th>size (A / B where they differ)</th>"
             "<th>dtype (A / B where they differ)</th></tr>"]
    for r in fb.get("rows") or []:
        ra, rb = r.get("a") or {}, r.get("b") or {}
        style = ' style="background:#fde2e0"' if not r.get("same", True) else ""
        table.append(f"<tr{style}><td>{_e(r.get('position'))}</td><td class=mono>{_e(ra.get('fqn'))}"
                     f"</td><td>{_e(ra.get('offset'))}</td><td class=mono>{_e(rb.get('fqn'))}</td>"
                     f"<td>{_e(rb.get('offset'))}</td><td>{_size_cell(ra, rb)}</td>"
                     f"<td>{_dtype_cell(ra, rb)}</td></tr>")
    table.append("</table></div>")
    return (f'<section id="{anchor}"><h3>{head}</h3>{seen}{where}{bucket_svg(fb, *labels)}'
            f'{"".join(table)}</section>')


def _dtype_cell(ra: dict, rb: dict) -> str:
    """Both sides' dtypes where they differ (A / B, marked), else the one dtype."""
    da, db = ra.get("dtype"), rb.get("dtype")
    if ra and rb and da != db:
        return f'<b class=sizediff style="color:{MARK}">{_e(da)} / {_e(db)}</b>'
    return _e(da if ra else db)


def _size_cell(ra: dict, rb: dict) -> str:
    """Both sides' sizes where they differ (A / B, marked), else the one size."""
    sa, sb = ra.get("size"), rb.get("size")
    if ra and rb and sa != sb:
        return f'<b class=sizediff style="color:{MARK}">{_e(sa)} / {_e(sb)}</b>'
    return _e(sa if ra else sb)


def _bucket_findings(cells: list[tuple[CellResult, DiffResult | None]],
                     labels: tuple[str, str]) -> tuple[str, dict]:
    """One section per distinct finding (cells grouped); {cell id: anchor}."""
    groups: dict[str, list[CellResult]] = {}
    fbs: dict[str, dict] = {}
    for cell, diff in cells:
        fb = diff.order.first_bucket if diff else None
        if isinstance(fb, dict):
            key = _fingerprint(fb)
            groups.setdefault(key, []).append(cell)
            fbs.setdefault(key, fb)
    anchors, sections = {}, []
    for i, (key, same) in enumerate(groups.items()):
        anchor = f"bucket-{i}"
        for cell in same:
            anchors[got(cell.id)] = anchor
        sections.append(_bucket_section(fbs[key], anchor, labels, same))
        # issue 20: the finding's other differing buckets too, most consequential first
        for k, view in enumerate(pair_views(same[0].diff or {})[1:SWEEP_EXTRA_BUCKETS + 1]):
            sections.append(_bucket_section(view, f"{anchor}-{k + 1}", labels, []))
    return "".join(sections), anchors


# ------------------------------------------------------------------------------------ tables


def _divergent_table(cells: list[tuple[CellResult, DiffResult | None, str]],
                     show_cell: bool = True) -> str:
    """Every divergent parameter of each (cell, its diff, the anchor of its bucket picture),
    with the size of its difference where the runs recorded figures."""
    rows = []
    sized = any(diff is not None and (diff.magnitude or {}).get("recorded")
                for _, diff, _ in cells)
    for cell, diff, anchor in cells:
        sizes = first_sizes(diff.magnitude) if diff is not None else {}
        for div in diff.divergent if diff else []:
            where = []
            for coll, refs in div.buckets.items():  # collective -> {"a": ref, "b": ref}
                for side in ("a", "b"):
                    ref = refs.get(side)
                    if isinstance(ref, dict):
                        where.append(_e(f"{side.upper()} {coll} #{ref.get('index')} @ "
                                        f"{ref.get('offset')}"))
            link = f'<a href="#{anchor}">bucket picture</a>' if anchor else ""
            first = f"<td>{_e(got(cell.id))}</td>" if show_cell else ""
            size = ""
            if sized:
                rel, ulps = size_texts(sizes.get((div.fqn, div.kind,
                                                  div.ranks[0] if div.ranks else None)))
                size = f"<td>{_e(rel)}</td><td>{_e(ulps)}</td>"
            rows.append(f"<tr>{first}<td>{_e(div.step)}</td>"
                        f"<td>{_e(div.kind)}</td><td class=mono>{_e(div.fqn)}</td>"
                        f"<td>{_e(','.join(map(str, div.ranks)))}</td>"
                        f"<td class=loc>{'<br>'.join(where)}</td>{size}<td>{link}</td></tr>")
    if not rows:
        return "<p class=muted>No divergent parameters: every compared hash is equal.</p>"
    head = "<th>cell</th>" if show_cell else ""
    size_head = ("<th title=\"a lower bound from per-tensor figures (summaries, not proofs), on "
                 "the first rank listed\">rel. diff &gt;=</th><th>ulps</th>" if sized else "")
    return (f"<div class=wide><table><tr>{head}<th>step</th><th>kind</th><th>parameter</th>"
            f"<th>ranks</th><th>bucket @ byte offset</th>{size_head}<th></th></tr>"
            + "".join(rows[:500]) + "</table></div>")


def _run_meta(run_dir: str | None) -> dict:
    if not run_dir:
        return {}
    try:
        return json.loads((rank_dir(run_dir, 0) / META_FILE).read_text())
    except (OSError, ValueError):
        return {}


def trainer_command(cmd) -> str:
    """The job's own command: parity's bootstrap prefix (``... exec --out DIR --``) removed."""
    if not isinstance(cmd, list):
        return str(cmd or "")
    cmd = [str(x) for x in cmd]
    if "exec" in cmd and "--" in cmd[cmd.index("exec"):]:
        cmd = cmd[cmd.index("--", cmd.index("exec")) + 1:]
    return shlex.join(cmd)


def _href(path: str, page_dir: str | None) -> str:
    """A link from the page to ``path`` (relative when the page's folder is known)."""
    if page_dir:
        try:
            path = os.path.relpath(path, page_dir)
        except ValueError:
            pass
    return html.escape(path.replace(os.sep, "/").replace(" ", "%20"), quote=True)


def _runs(report: SweepReport, page_dir: str | None) -> str:
    base = report.dir or ""
    rows = []

    def here(p):
        return os.path.join(base, p) if p and base and not os.path.isabs(p) else p

    for cell in report.cells or []:
        for side_name, side in (cell.sides or {}).items():
            if not isinstance(side, SideResult) or side.status == "not_run":
                continue
            meta = _run_meta(here(got(side.run_dir)))
            logs = [got(side.console_log)] + [r.get(k) for r in side.rank_logs or []
                                                if isinstance(r, dict)
                                                for k in ("stdout", "stderr")]
            links = " ".join(f'<a href="{_href(here(p), page_dir)}">{_e(os.path.basename(p))}</a>'
                             for p in logs if p)
            rows.append(f"<tr><td>{_e(got(cell.id))}</td><td>{_e(side_name)}</td>"
                        f"<td>{_e(got(side.status))}</td><td>{_e(meta.get('torch'))}</td>"
                        f"<td>{_e(meta.get('world_size'))}</td>"
                        f"<td class=mono>{_e(trainer_command(got(side.command)))}</td>"
                        f"<td>{links}</td></tr>")
    if not rows:
        return ""
    return ("<h2>Runs</h2><details><summary>" + f"{len(rows)} jobs: torch version, world size, "
            "the trainer's command, logs</summary><div class=wide><table><tr><th>cell</th>"
            "<th>side</th><th>status</th><th>torch</th><th>world size</th><th>command</th>"
            "<th>logs</th></tr>" + "".join(rows) + "</table></div></details>")


def _page(title: str, body: list[str]) -> str:
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>{''.join(body)}"
            "</body></html>\n")


# ------------------------------------------------------------------------------------ the pages


def render_sweep_html(sweep: SweepReport | dict, fail_on: str | None = None,
                      page_dir: str | None = None) -> str:
    """The sweep page: the gate's verdict line, the matrix, each distinct bucket finding once,
    divergent parameters, the runs (collapsed). ``sweep``: typed, or sweep.json as
    ``load_sweep`` returns it (typed here, once; each cell's diff too)."""
    from parity.diff.bucket_summary import cell_headline

    report = as_report(sweep)
    cells = report.cells or []
    typed = [(cell, diff_from_dict(cell.diff) if isinstance(cell.diff, dict) else None)
             for cell in cells]
    axes = axis_names(report)
    n_steps = got(report.steps)
    all_steps = sorted({s for _, diff in typed if diff for s in diff.steps_compared})
    steps = list(range(0, int(n_steps) + 1)) if isinstance(n_steps, int) else all_steps or [0]
    sides = report.sides or {}
    labels = (str((sides.get("reference") or {}).get("label") or "reference"),
              str((sides.get("candidate") or {}).get("label") or "candidate"))
    pol = policy.check(fail_on or report.fail_on or policy.DEFAULT)
    verdict, _ = policy.judge_sweep(report, pol)
    findings, anchors = _bucket_findings(typed, labels)
    head = "".join(f"<th>{_e(a)}</th>" for a in axes)
    rows = []
    for cell, diff in typed:
        status = got(cell.status, "?")
        vals = "".join(f"<td>{_e(_value((cell.axes or {}).get(a)))}</td>" for a in axes)
        anchor = anchors.get(got(cell.id))
        layout = f'<a href="#{anchor}">layout</a>' if anchor else ""
        code = policy.cell_code(cell, pol)
        tol = " <span class=muted>(tolerated)</span>" if code == 0 and status != "match" else ""
        where = ""
        if diff and diff.first_divergent_step is not None:
            where = f"step {diff.first_divergent_step}"
            if diff.first_divergence and diff.first_divergence.ranks:
                where += f", rank {','.join(map(str, diff.first_divergence.ranks))}"
        rows.append(
            f"<tr>{vals}<td><span class=badge style=\"background:{STATUS_COLOURS.get(status, '#444')}"
            f"\">{_e(status)}</span>{tol}</td><td>{_e(where)}</td>"
            f"<td>{_strip(cell, diff, steps)}</td><td>{layout}</td>"
            f"<td class=\"muted detail\">{_e(got(cell.reason))}</td>"
            f"<td class=mono>{_e(cell_headline(cell.diff or {}))}</td></tr>")
    counts: dict[str, int] = {}
    for cell in cells:
        counts[got(cell.status, "?")] = counts.get(got(cell.status, "?"), 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    name = got(report.name, "sweep")
    body = [
        f"<h1>parity sweep: {_e(name)}</h1>",
        f"<div class=muted>{_e(got(report.description))}</div>",
        _verdict_block(verdict),
        f"<p>{len(cells)} cells: {_e(summary)}</p>",
        "<h2>Cells</h2>", _legend(),
        f"<div class=wide><table><tr>{head}<th>status</th><th>diverges at</th>"
        f"<th title=\"step 0: initial parameters\">steps {_e(steps[0])}-{_e(steps[-1])}</th>"
        f"<th></th><th>detail</th><th>bucketing A vs B</th></tr>",
        "".join(rows), "</table></div>",
        "<h2>Bucket layout findings</h2>",
        findings or "<p class=muted>Every compared bucket layout is identical.</p>",
        "<h2>Divergent parameters</h2>",
        _divergent_table([(cell, diff, anchors.get(got(cell.id), "")) for cell, diff in typed]),
        _runs(report, page_dir),
        f"<p class=muted>written by parity {time.strftime('%Y-%m-%d %H:%M:%S')}"
        + (f"; sweep directory <code>{_e(report.dir)}</code>" if report.dir else "")
        + "</p>",
    ]
    return _page(f"parity sweep: {name}", body)


def render_diff_html(diff: DiffResult | dict, fail_on: str = "hash") -> str:
    """The page of one ``parity diff``: what the console shows, the verdict line, summary, loss
    side by side, per-step counts, divergent parameters, and the first differing bucket as a
    picture. ``diff``: the result, or its JSON (``DiffResult.to_dict()``, typed here once)."""
    from parity.report import html_charts as charts

    result = diff if isinstance(diff, DiffResult) else diff_from_dict(diff)
    d = diff.to_dict() if isinstance(diff, DiffResult) else diff  # the charts read the JSON
    verdict = policy.judge_pair(d, fail_on)
    a, b, order, fd = result.a, result.b, result.order, result.first_divergence
    steps = result.steps_compared
    status = policy.status(result.verdict, order.verdict)
    summary = [
        ("Status", f'<span class=badge style="background:{STATUS_COLOURS.get(status, "#444")}">'
                   f"{_e(status)}</span>"),
        ("A (reference)", f"<code>{_e(a.path)}</code> "
                          f"<span class=muted>manifests: {_e(a.bucket_source or 'none')}</span>"),
        ("B (candidate)", f"<code>{_e(b.path)}</code> "
                          f"<span class=muted>manifests: {_e(b.bucket_source or 'none')}</span>"),
        ("World size", _e(result.world_size)),
        ("Ranks compared", _e(",".join(map(str, result.ranks_compared)))),
        ("Steps compared", f"{len(steps)} ({_e(steps[0] if steps else '-')}-"
                           f"{_e(steps[-1] if steps else '-')}) <span class=muted>step 0: initial "
                           "parameters; step N: after optimizer step N</span>"),
        ("Parameters", f"{_e(result.params_compared)} "
                       f"<span class=muted>({_e(', '.join(result.kinds_compared))})</span>"),
    ]
    if fd:  # the label says what was compared and found, not which pass
        summary.append(("First divergence", f"step {_e(fd.step)}: <b>{_e(fd.label or fd.origin)}"
                                            f"</b> on rank(s) {_e(','.join(map(str, fd.ranks)))}: "
                                            f"{_e(fd.explanation)}"))
    else:
        summary.append(("First divergence", "none"))
    summary.append(("Bucket layouts", _e(order.verdict) + (
        f" <span class=muted>({_e(order.a_source)} vs {_e(order.b_source)}, rank "
        f"{_e(order.rank)})</span>" if order.compared else "")))
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in summary)
    loss = result.loss
    loss_rows = []
    other = False
    for step in loss.steps:
        style = ' style="background:#fde2e0"' if step.equal is False else ""
        bitwise = "equal" if step.equal else ("-" if step.equal is None else
                                               f"DIFFERS on {step.ranks_differing} rank(s)")
        # a step whose loss differs on another rank only shows that rank's values
        rank, la, lb = step.shown(result.ranks_compared, loss.rank)
        other = other or rank != loss.rank
        delta = step.delta(result.ranks_compared, loss.rank)
        loss_rows.append(f"<tr{style}><td>{_e(step.step)}</td>"
                         f"<td>{_e(rank)}{'*' if rank != loss.rank else ''}</td><td class=mono>"
                         f"{_e(repr(la))}</td><td class=mono>{_e(repr(lb))}</td>"
                         f"<td>{_e('0' if delta == 0 else f'{delta:.2g}' if delta is not None else '-')}"
                         f"</td><td>{bitwise}</td></tr>")
    loss_rows = "".join(loss_rows)
    note = (f"<p class=muted>* rank {_e(loss.rank)}'s loss is equal at that step; the first rank "
            "whose loss differs is shown.</p>" if other else "")
    loss_html = (f"<h2>Loss, side by side</h2>"
                 f"{charts.loss_svg(d.get('loss') or {}, result.ranks_compared)}<table><tr><th>step"
                 f"</th><th>rank</th><th>A</th><th>B</th><th>(B-A)/|A|</th><th>bitwise</th></tr>"
                 f"{loss_rows}</table>{note}"
                 if loss.captured and loss_rows else "<p class=muted>Loss not captured.</p>")
    per_html = ""
    if result.per_step:
        per_html = ("<h2>Divergent per step</h2><p class=muted>parameters and gradients whose hash "
                    "differs on any rank</p>" + charts.divergent_svg(d)
                    + "<table><tr><th>step</th><th>params</th><th>grads</th>"
                    "<th>ranks</th></tr>" + "".join(
                        f"<tr><td>{_e(count.step)}</td><td>{_e(count.params)}</td>"
                        f"<td>{_e(count.grads)}</td><td>{_e(count.ranks)}</td></tr>"
                        for count in result.per_step) + "</table>")
    cell = CellResult(id=None, status=status, diff=d)
    findings, anchors = _bucket_findings([(cell, result)], ("reference", "candidate"))
    strip_steps = list(range(0, (max(steps) if steps else 0) + 1))
    body = [
        "<h1>parity diff</h1>",
        f"<div class=muted>A <code>{_e(a.path)}</code> vs B <code>{_e(b.path)}</code>"
        "</div>",
        _verdict_block(verdict),
        _said_html(result),
        f"<table>{table}</table>",
        f"<p>Steps: {_strip(cell, result, strip_steps)}</p>", _legend(),
        loss_html, per_html, charts.size_section(d),
        "<h2>Divergent parameters</h2>",
        _divergent_table([(cell, result, anchors.get(None, ""))], show_cell=False),
        "<h2>Differing buckets, most consequential first</h2>",
        buckets_html(d, lambda fb, anchor: _bucket_section(fb, anchor, ("reference",
                                                                         "candidate"), []))
        or findings or "<p class=muted>Every compared bucket layout is identical.</p>",
        prediction_html(d),
        charts.bucketing_section(d),
        f"<p class=muted>written by parity {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
    ]
    return _page("parity diff", body)


def _said_html(result: DiffResult) -> str:
    """Incomplete reasons and capture warnings of a diff (every one, as the console lists them)."""
    items = [f"incomplete: {m}" for m in result.incomplete]
    for w in result.warnings:
        items.append(f"capture warning ({str(w.side or '?').upper()} rank(s) "
                     f"{w.ranks}): {w.message}")
    if not items:
        return ""
    return "<ul class=warnings>" + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>"


def write_sweep_html(sweep: SweepReport | dict, path: str | os.PathLike,
                     fail_on: str | None = None) -> None:
    """Write the sweep's page (``sweep``: a SweepReport, its ``dir`` set when known, or sweep.json
    as ``load_sweep`` returns it); links to logs are relative to the page's folder."""
    page_dir = os.path.dirname(os.path.abspath(path))
    write_text_atomic(path, render_sweep_html(sweep, fail_on, page_dir))


def write_diff_html(result, path: str | os.PathLike, fail_on: str = "hash") -> None:
    """The page of one ``parity diff`` under ``fail_on`` (its own wording, not a sweep's)."""
    write_text_atomic(path, render_diff_html(result, fail_on))
