"""One self-contained HTML file for a sweep or a diff: a heatmap of cells by steps, and the first
differing bucket of each cell drawn as two byte-offset bars.

Why pictures: a bucket-order bug is two rows of byte ranges where the same parameters sit at
different offsets, and a sweep verdict is a matrix that stays green until the first divergence.
Hand-made inline SVG keeps the file self-contained (no network, no scripts, no assets) and crisp
at any zoom. Every piece of text goes through ``html.escape``: parameter names and axis values
are user data.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import shlex
import time
from pathlib import Path

from parity.artifacts import write_text_atomic
from parity.report.text import safe_text

STATE_COLOURS = {
    "equal": "#2e9d58", "divergent": "#d0392b", "missing": "#d9d9d9", "failed": "#5b1a1a",
    "skipped": "#b8b8b8",
}
STATUS_COLOURS = {
    "match": "#2e9d58", "hash_mismatch": "#d0392b", "order_mismatch": "#e08a1e",
    "failed": "#5b1a1a", "skipped": "#8c8c8c",
}
BAR_WIDTH = 960
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d1d1f;
max-width:1200px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:18px 0 6px}table{border-collapse:collapse;margin:6px 0}
th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f6f6f6}td.mono{word-break:break-all;max-width:420px}code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.badge{color:#fff;border-radius:4px;padding:1px 7px;font-size:12px;white-space:nowrap}
.muted{color:#777}.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
.verdict{font-size:16px;font-weight:600;margin:6px 0 14px}
"""


def _e(x) -> str:
    return html.escape(safe_text(x, keep_lines=True), quote=True)


def _colour(fqn: str) -> str:
    """The same parameter gets the same colour on both bars (and in every cell)."""
    h = int.from_bytes(hashlib.blake2b(fqn.encode(), digest_size=4).digest(), "big")
    return f"hsl({h % 360},{55 + h // 360 % 25}%,{62 + h // 9000 % 14}%)"


def _short(fqn: str) -> str:
    parts = fqn.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else fqn


# ------------------------------------------------------------------------------------- heatmap


def _step_states(cell: dict, steps: list[int]) -> list[tuple[str, str]]:
    """(state, tooltip) per step for one cell's strip."""
    status = cell.get("status")
    if status == "skipped":
        return [("skipped", f"step {s}: skipped ({cell.get('reason') or ''})") for s in steps]
    diff = cell.get("diff") or {}
    compared = set(diff.get("steps_compared") or [])
    first = diff.get("first_divergent_step")
    counts = {p.get("step"): p for p in diff.get("per_step") or [] if isinstance(p, dict)}
    out = []
    for s in steps:
        if s not in compared:
            state = "failed" if status == "failed" else "missing"
            out.append((state, f"step {s}: not compared ({state})"))
        elif first is not None and s >= first:
            p = counts.get(s, {})
            n = p.get("params", "?")
            g = p.get("grads", "?")
            out.append(("divergent", f"step {s}: {n} parameters, {g} gradients differ"))
        else:
            out.append(("equal", f"step {s}: bitwise equal"))
    return out


def _strip(cell: dict, steps: list[int]) -> str:
    w, gap, h = 18, 2, 18
    states = _step_states(cell, steps)
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


def bucket_svg(fb: dict, ref_label: str = "reference", cand_label: str = "candidate") -> str:
    """Two horizontal byte-offset bars (A above, B below), one segment per parameter."""
    rows = fb.get("rows") or []
    entries = {"a": [r["a"] for r in rows if r.get("a")], "b": [r["b"] for r in rows if r.get("b")]}
    total = max([int(e.get("offset") or 0) + int(e.get("size") or 0)
                 for side in entries.values() for e in side] or [1]) or 1
    left, bar_h, top = 160, 34, 22
    width = left + BAR_WIDTH + 20
    scale = BAR_WIDTH / total
    first = fb.get("position")
    parts = [f'<text x="{left}" y="14" class="mono" font-size="11" fill="#555">byte 0</text>',
             f'<text x="{left + BAR_WIDTH}" y="14" class="mono" font-size="11" fill="#555" '
             f'text-anchor="end">{total:,} bytes</text>']
    for k, (side, label) in enumerate((("a", f"A {ref_label}"), ("b", f"B {cand_label}"))):
        y = top + k * (bar_h + 26)
        parts.append(f'<text x="0" y="{y + bar_h / 2 + 4}" font-size="12">{_e(label[:24])}'
                     f'<title>{_e(label)}</title></text>')
        for pos, e in enumerate(entries[side]):
            off, size = int(e.get("offset") or 0), int(e.get("size") or 0)
            x, w = left + off * scale, max(size * scale, 1.0)
            fqn = str(e.get("fqn"))
            marked = pos == first
            stroke = ' stroke="#c00" stroke-width="3"' if marked else ' stroke="#fff" stroke-width="1"'
            tip = (f"{fqn}\nposition {pos}, offset {off:,} B, size {size:,} B, "
                   f"{e.get('numel', '?')} elements, {e.get('dtype', '?')}")
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" '
                         f'fill="{_colour(fqn)}"{stroke}><title>{_e(tip)}</title></rect>')
            if w > 46:
                parts.append(f'<text x="{x + 3:.2f}" y="{y + bar_h / 2 + 4}" font-size="10.5" '
                             f'clip-path="inset(0)" pointer-events="none">'
                             f'{_e(_short(fqn)[: int(w / 6.2)])}</text>')
            if marked:
                parts.append(f'<path d="M{x + w / 2:.2f},{y - 2} l-5,-8 h10 z" fill="#c00"/>')
    height = top + 2 * bar_h + 30
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="bucket layout">{"".join(parts)}</svg>')


def _bucket_section(cell: dict, anchor: str, labels: tuple[str, str]) -> str:
    diff = cell.get("diff") or {}
    fb = (diff.get("order") or {}).get("first_bucket")
    if not fb:
        return ""
    a, b = fb.get("a") or {}, fb.get("b") or {}
    head = (f"{_e(fb.get('collective'))} bucket {_e(fb.get('index'))} "
            f"({_e(fb.get('group') or 'root')}) vs candidate bucket {_e(fb.get('b_index'))}: "
            f"{_e(fb.get('verdict'))}")
    where = ""
    if a or b:
        where = (f"<p>first differing position <b>{_e(fb.get('position'))}</b>: A "
                 f"<code>{_e(a.get('fqn'))}</code> @ byte {_e(a.get('offset'))}, B "
                 f"<code>{_e(b.get('fqn'))}</code> @ byte {_e(b.get('offset'))}. "
                 f"<span class=muted>{_e(fb.get('detail'))}</span></p>")
    table = ["<table><tr><th>pos</th><th>A parameter</th><th>A offset</th><th>B parameter</th>"
             "<th>B offset</th><th>size</th><th>dtype</th></tr>"]
    for r in fb.get("rows") or []:
        ra, rb = r.get("a") or {}, r.get("b") or {}
        style = ' style="background:#fde2e0"' if r.get("position") == fb.get("position") else (
            "" if r.get("same") else ' style="background:#fff4d6"')
        table.append(f"<tr{style}><td>{_e(r.get('position'))}</td><td class=mono>{_e(ra.get('fqn'))}"
                     f"</td><td>{_e(ra.get('offset'))}</td><td class=mono>{_e(rb.get('fqn'))}</td>"
                     f"<td>{_e(rb.get('offset'))}</td><td>{_e(ra.get('size', rb.get('size')))}</td>"
                     f"<td>{_e(ra.get('dtype', rb.get('dtype')))}</td></tr>")
    table.append("</table>")
    return (f'<section id="{anchor}"><h3>{_e(cell.get("id"))}: {head}</h3>{where}'
            f'{bucket_svg(fb, *labels)}{"".join(table)}</section>')


# ------------------------------------------------------------------------------------ the page


def _divergent_table(cells: list[tuple[dict, str]]) -> str:
    rows = []
    for cell, anchor in cells:
        for d in (cell.get("diff") or {}).get("divergent") or []:
            buckets = d.get("buckets") or {}
            where = []
            for coll, sides in buckets.items() if isinstance(buckets, dict) else []:
                if isinstance(sides, dict):
                    for side in ("a", "b"):
                        loc = sides.get(side)
                        if isinstance(loc, dict):
                            where.append(f"{side.upper()} {coll} #{loc.get('index')} @ "
                                         f"{loc.get('offset')}")
            link = f'<a href="#{anchor}">bucket picture</a>' if anchor else ""
            rows.append(f"<tr><td>{_e(cell.get('id'))}</td><td>{_e(d.get('step'))}</td>"
                        f"<td>{_e(d.get('kind'))}</td><td class=mono>{_e(d.get('fqn'))}</td>"
                        f"<td>{_e(','.join(map(str, d.get('ranks') or [])))}</td>"
                        f"<td class=mono>{_e('; '.join(where))}</td><td>{link}</td></tr>")
    if not rows:
        return "<p class=muted>No divergent parameters: every compared hash is equal.</p>"
    return ("<table><tr><th>cell</th><th>step</th><th>kind</th><th>parameter</th><th>ranks</th>"
            "<th>bucket @ byte offset</th><th></th></tr>" + "".join(rows[:500]) + "</table>")


def _run_meta(run_dir: str | None) -> dict:
    if not run_dir:
        return {}
    try:
        return json.loads((Path(run_dir) / "rank-00000" / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def _metadata(sweep: dict) -> str:
    base = sweep.get("_dir") or ""
    rows = []
    for cell in sweep.get("cells") or []:
        for side, s in (cell.get("sides") or {}).items():
            if not isinstance(s, dict):
                continue
            run_dir = s.get("run_dir")
            if run_dir and base and not os.path.isabs(run_dir):
                run_dir = os.path.join(base, run_dir)
            meta = _run_meta(run_dir)
            cmd = s.get("command")
            cmd = shlex.join(map(str, cmd)) if isinstance(cmd, list) else (cmd or "")
            logs = [s.get("console_log")] + [r.get("stdout") for r in s.get("rank_logs") or []
                                             if isinstance(r, dict)] + [
                r.get("stderr") for r in s.get("rank_logs") or [] if isinstance(r, dict)]
            logs = [l for l in logs if l]
            rows.append(f"<tr><td>{_e(cell.get('id'))}</td><td>{_e(side)}</td>"
                        f"<td>{_e(s.get('status'))}</td><td>{_e(meta.get('torch'))}</td>"
                        f"<td>{_e(meta.get('world_size'))}</td><td class=mono>{_e(cmd)}</td>"
                        f"<td class=mono>{'<br>'.join(_e(l) for l in logs)}</td></tr>")
    if not rows:
        return ""
    return ("<h2>Runs</h2><table><tr><th>cell</th><th>side</th><th>status</th><th>torch</th>"
            "<th>world size</th><th>command</th><th>logs</th></tr>" + "".join(rows) + "</table>")


def render_sweep_html(sweep: dict) -> str:
    cells = sweep.get("cells") or []
    axes = list(sweep.get("axes") or {}) if isinstance(sweep.get("axes"), dict) else []
    if not axes:
        axes = sorted({a for c in cells for a in (c.get("axes") or {})})
    n_steps = sweep.get("steps")
    all_steps = sorted({s for c in cells for s in ((c.get("diff") or {}).get("steps_compared") or [])})
    steps = list(range(0, int(n_steps) + 1)) if isinstance(n_steps, int) else all_steps or [0]
    sides = sweep.get("sides") or {}
    labels = (str((sides.get("reference") or {}).get("label") or "reference"),
              str((sides.get("candidate") or {}).get("label") or "candidate"))

    anchors = {}
    for i, c in enumerate(cells):
        if ((c.get("diff") or {}).get("order") or {}).get("first_bucket"):
            anchors[c.get("id")] = f"bucket-{i}"
    head = "".join(f"<th>{_e(a)}</th>" for a in axes)
    rows = []
    for c in cells:
        status = c.get("status", "?")
        diff = c.get("diff") or {}
        vals = "".join(f"<td>{_e((c.get('axes') or {}).get(a))}</td>" for a in axes)
        anchor = anchors.get(c.get("id"))
        layout = f'<a href="#{anchor}">layout</a>' if anchor else ""
        rows.append(
            f"<tr>{vals}<td><span class=badge style=\"background:{STATUS_COLOURS.get(status, '#444')}"
            f"\">{_e(status)}</span></td><td>{_e(diff.get('first_divergent_step', ''))}</td>"
            f"<td>{_strip(c, steps)}</td><td>{layout}</td><td class=muted>{_e(c.get('reason'))}</td></tr>")
    counts = sweep.get("counts") or {}
    verdict = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or f"{len(cells)} cells"
    buckets = "".join(_bucket_section(c, anchors[c.get("id")], labels) for c in cells
                      if c.get("id") in anchors)
    body = [
        f"<h1>parity: {_e(sweep.get('name', 'report'))}</h1>",
        f"<div class=muted>{_e(sweep.get('description'))}</div>",
        f"<div class=verdict>{_e(verdict)}</div>",
        "<h2>Sweep matrix</h2>", _legend(),
        f"<table><tr>{head}<th>status</th><th>first divergent step</th>"
        f"<th>steps {_e(steps[0])}-{_e(steps[-1])}</th><th></th><th>reason</th></tr>",
        "".join(rows), "</table>",
        "<h2>First differing bucket per cell</h2>",
        buckets or "<p class=muted>Every compared bucket layout is identical.</p>",
        "<h2>Divergent parameters</h2>",
        _divergent_table([(c, anchors.get(c.get("id"), "")) for c in cells]),
        _metadata(sweep),
        f"<p class=muted>written by parity {time.strftime('%Y-%m-%d %H:%M:%S')}; "
        f"sweep directory <code>{_e(sweep.get('_dir', ''))}</code></p>",
    ]
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>parity: {_e(sweep.get('name', 'report'))}</title>"
            f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n")


def write_sweep_html(sweep: dict, path: str | os.PathLike) -> None:
    """Write the sweep's report (``sweep`` is the sweep JSON, with ``_dir`` when known)."""
    write_text_atomic(path, render_sweep_html(sweep))


def write_diff_html(result, path: str | os.PathLike) -> None:
    """The same page for one ``parity diff``: a one-cell matrix, its bucket, its parameters."""
    d = result.to_dict()
    status = "match" if d.get("verdict") == "match" else d.get("verdict", "?")
    if status == "match" and (d.get("order") or {}).get("verdict") not in (None, "identical",
                                                                             "unavailable"):
        status = "order_mismatch"
    steps = d.get("steps_compared") or [0]
    reason = f"A {(d.get('a') or {}).get('path')} vs B {(d.get('b') or {}).get('path')}"
    said = [f"incomplete: {m}" for m in (d.get("incomplete") or [])[:2]]
    said += [f"capture warning ({w['side'].upper()} rank(s) {w['ranks']}): {w['message']}"
             for w in (d.get("warnings") or [])[:3]]
    cell = {"id": "diff", "axes": {}, "status": status, "diff": d,
            "reason": "; ".join([reason, *said])}
    sweep = {"name": "diff", "description": cell["reason"], "cells": [cell],
             "steps": max(steps), "counts": {status: 1}}
    write_text_atomic(path, render_sweep_html(sweep))
