"""HTML parts for issue 20: every differing bucket of one diff drawn, the most consequential
first (reductions, whose sums may change, before copies, whose values do not), and the
reduction-order prediction (``--at``) as a table. html.py renders each bucket's picture; this
module decides which and in what order, from the diff's JSON."""

from __future__ import annotations

import html as _html

from parity import consequences as cq

MAX_DRAWN = 40  # buckets drawn on one page; the rest are listed
SWEEP_EXTRA_BUCKETS = 8  # a sweep page: differing buckets drawn per finding after its headline


def _e(x) -> str:
    return _html.escape("" if x is None else str(x))


def pair_views(d: dict) -> list[dict]:
    """The differing bucket groups of a diff as ``first_bucket``-shaped dicts (what the bucket
    picture reads), most consequential first; the headline (``order.first_bucket``) leads."""
    order = d.get("order") if isinstance(d.get("order"), dict) else {}
    fb = order.get("first_bucket") if isinstance(order.get("first_bucket"), dict) else None
    views = []
    for i, p in enumerate(order.get("pairs") or []):
        if not isinstance(p, dict) or p.get("verdict") in (None, "identical") or not p.get("rows"):
            continue
        a, b = (p.get("a") or {}).get("buckets") or [], (p.get("b") or {}).get("buckets") or []
        ga, gb = (p.get("a") or {}).get("groups") or [], (p.get("b") or {}).get("groups") or []
        views.append((cq.lead_key(p.get("consequence"), p.get("verdict"), i), {
            "collective": p.get("collective"), "verdict": p.get("verdict"),
            "consequence": p.get("consequence"), "index": a[0] if a else None,
            "b_index": b[0] if b else None, "group": ga[0] if ga else None,
            "b_group": gb[0] if gb else None, "position": p.get("position"),
            "a": p.get("a_entry"), "b": p.get("b_entry"), "detail": p.get("detail") or "",
            "rows": p.get("rows")}))
    out = [v for _, v in sorted(views, key=lambda kv: kv[0])]
    if fb is not None and not out:
        out = [fb]  # an older diff JSON: only the headline has rows
    return out


def buckets_html(d: dict, render) -> str:
    """Every differing bucket (``render(view, anchor)`` draws one), most consequential first."""
    views = pair_views(d)
    if not views:
        return ""
    order = d.get("order") or {}
    head = (f"<p>{_e(cq.counts_phrase(order.get('consequences')))}. Reductions first: their "
            "payload order decides which NCCL channel, and so which rank order, sums each "
            "element on a multi-node ring; all-gathers copy (values unchanged).</p>"
            if order.get("consequences") else "")
    parts = [head]
    for k, v in enumerate(views[:MAX_DRAWN]):
        parts.append(render(v, f"bucket-{k}"))
    if len(views) > MAX_DRAWN:
        parts.append(f"<p class=muted>... and {len(views) - MAX_DRAWN} more differing buckets "
                     "(--json has all).</p>")
    return "".join(parts)


def prediction_html(d: dict) -> str:
    """The ``reduction_order`` object as a short paragraph and a table."""
    ro = d.get("reduction_order")
    if not isinstance(ro, dict):
        return ""
    topo = ro.get("topology") or {}
    colour = {"differs": "#c0392b", "same": "#1e8449"}.get(ro.get("verdict"), "#b9770e")
    rows = sorted([x for x in ro.get("at_risk") or [] if isinstance(x, dict)],
                  key=lambda x: -(x.get("elements") or 0))
    table = ""
    if rows:
        table = ("<div class=wide><table><tr><th>parameter at risk</th><th>elements</th>"
                 "<th>fraction</th><th>RS bucket A / B</th><th>why</th></tr>" + "".join(
                     f"<tr><td class=mono>{_e(x.get('fqn'))}</td><td>{(x.get('elements') or 0):,}"
                     f"</td><td>{100 * (x.get('fraction') or 0):.1f}%</td><td>"
                     f"{_e((x.get('bucket') or {}).get('a'))} / {_e((x.get('bucket') or {}).get('b'))}"
                     f"</td><td>{_e(x.get('why'))}</td></tr>" for x in rows[:500])
                 + "</table></div>")
    unp = "".join(f"<li>reduce_scatter A#{_e(u.get('a'))} / B#{_e(u.get('b'))}: "
                  f"{_e(u.get('reason'))}</li>" for u in ro.get("unpredicted") or [])
    notes = "".join(f"<li>{_e(n)}</li>" for n in ro.get("notes") or [])
    return (f"<h2>Reduction order at {_e(topo.get('spec'))}</h2>"
            f"<p><b style=\"color:{colour}\">{_e(cq.reduction_phrase(ro))}</b></p>"
            f"<p class=muted>model {_e(ro.get('model'))}: {_e(ro.get('limits'))}; world "
            f"{_e(topo.get('world'))}, rings from {_e(ro.get('source'))}; docs/reduction-order.md"
            f"</p>{table}" + (f"<p>Not predicted:</p><ul>{unp}</ul>" if unp else "")
            + (f"<ul class=muted>{notes}</ul>" if notes else ""))
