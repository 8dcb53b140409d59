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


def _bytes(n) -> str:
    if not isinstance(n, int):
        return "-"
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB" if n >= 2**10 \
        else f"{n} B"


def _one_prediction_html(ro: dict, several: bool) -> str:
    topo = ro.get("topology") or {}
    colour = {"differs": "#c0392b", "same": "#1e8449"}.get(ro.get("verdict"), "#b9770e")
    rows = sorted([x for x in ro.get("at_risk") or [] if isinstance(x, dict)],
                  key=lambda x: -(x.get("elements") or 0))
    table = ""
    if rows:
        table = ("<div class=wide><table><tr><th>parameter at risk</th><th>elements</th>"
                 "<th>fraction</th><th>bucket A / B</th><th>why</th></tr>" + "".join(
                     f"<tr><td class=mono>{_e(x.get('fqn'))}</td><td>{(x.get('elements') or 0):,}"
                     f"</td><td>{100 * (x.get('fraction') or 0):.1f}%</td><td>"
                     f"{_e((x.get('bucket') or {}).get('collective'))} "
                     f"{_e((x.get('bucket') or {}).get('a'))} / {_e((x.get('bucket') or {}).get('b'))}"
                     f"</td><td>{_e(x.get('why'))}</td></tr>" for x in rows[:500])
                 + "</table></div>")
    bk = sorted([b for b in ro.get("buckets") or [] if isinstance(b, dict)],
                key=lambda b: -(b.get("elements") or 0))
    reasoning = ""
    if bk:
        reasoning = ("<div class=wide><table><tr><th>bucket A / B</th><th>step</th><th>group</th>"
                     "<th>bytes per rank A / B</th><th>protocol: channels A / B (of the "
                     "communicator's)</th><th>ring family</th><th>elements at risk</th></tr>"
                     + "".join(
                         f"<tr><td>{_e(b.get('collective'))} {_e(b.get('a'))} / {_e(b.get('b'))}"
                         f"</td><td>{_e(b.get('step'))}</td><td>{_e(b.get('group'))}</td><td>"
                         f"{_bytes((b.get('bytes_per_rank') or {}).get('a'))} / "
                         f"{_bytes((b.get('bytes_per_rank') or {}).get('b'))}</td><td>"
                         + "; ".join(f"{_e(s.get('protocol'))}: "
                                     f"{_e((s.get('channels') or {}).get('a'))} / "
                                     f"{_e((s.get('channels') or {}).get('b'))} (of "
                                     f"{_e(s.get('comm_channels'))})"
                                     for s in b.get("scenarios") or [] if isinstance(s, dict))
                         + "</td><td>" + _e(", ".join(dict.fromkeys(
                             str(s.get("family")) for s in b.get("scenarios") or []
                             if isinstance(s, dict))))
                         + f"</td><td>{(b.get('elements') or 0):,}</td></tr>" for b in bk[:200])
                     + "</table></div>")
    unp = "".join(f"<li>{_e(u.get('collective'))} A#{_e(u.get('a'))} / B#{_e(u.get('b'))}: "
                  f"{_e(u.get('reason'))}</li>" for u in ro.get("unpredicted") or [])
    unk = "".join(f"<li>{_e(u.get('collective'))} A#{_e(u.get('a'))} / B#{_e(u.get('b'))}: "
                  f"{_e(u.get('reason'))}</li>" for u in ro.get("unknown") or [])
    notes = "".join(f"<li>{_e(n)}</li>" for n in [*(ro.get("assumptions") or []),
                                                   *(ro.get("notes") or [])])
    obs = ro.get("observed")
    observed = ""
    if isinstance(obs, dict):
        missed = obs.get("not_predicted") or []
        observed = (f"<p>Predicted against observed (both runs emulated at {_e(obs.get('topology'))}"
                    f"): {_e(obs.get('predicted'))} parameters predicted at risk, "
                    f"{_e(obs.get('diverged'))} gradients diverged at step {_e(obs.get('step'))}, "
                    f"{_e(obs.get('both'))} both"
                    + (f"; <b>not predicted: {_e(', '.join(map(str, missed)))}</b>" if missed
                       else "") + ".</p>")
    elif ro.get("emulated"):
        observed = (f"<p class=muted>Hashes compared under emulation at {_e(ro.get('emulated'))};"
                    f" predicted at {_e(topo.get('spec'))}.</p>")
    head = (f"<h3>At {_e(topo.get('spec'))}: <span style=\"color:{colour}\">"
            f"{_e(ro.get('verdict'))}</span></h3>" if several else "")
    return (head + reasoning + table + observed
            + (f"<p>Unknown (the model cannot know):</p><ul>{unk}</ul>" if unk else "")
            + (f"<p>Not predicted:</p><ul>{unp}</ul>" if unp else "")
            + (f"<ul class=muted>{notes}</ul>" if notes else ""))


def prediction_html(d: dict) -> str:
    """The ``reduction_order`` (one object, or a list for several topologies) as a short
    paragraph, one row per topology, and per topology the reasoning and the parameters."""
    ros = cq.predictions(d.get("reduction_order"))
    if not ros:
        return ""
    first = ros[0]
    verdict = cq.prediction_verdict(d.get("reduction_order"))
    colour = {"differs": "#c0392b", "same": "#1e8449"}.get(verdict, "#b9770e")
    specs = ", ".join(str((x.get("topology") or {}).get("spec")) for x in ros)
    rows = ""
    if len(ros) > 1:
        rows = ("<div class=wide><table><tr><th>topology</th><th>verdict</th><th>elements at "
                "risk</th><th>parameters</th></tr>" + "".join(
                    f"<tr><td>{_e((x.get('topology') or {}).get('spec'))}</td><td>"
                    f"{_e(x.get('verdict'))}</td><td>{sum(int(r.get('elements') or 0) for r in x.get('at_risk') or []):,}"
                    f"</td><td>{len(x.get('at_risk') or [])}</td></tr>" for x in ros)
                + "</table></div>")
    return (f"<h2>Reduction order at {_e(specs)}</h2>"
            f"<p><b style=\"color:{colour}\">{_e(cq.reduction_phrase(d.get('reduction_order')))}"
            f"</b></p><p class=muted>At risk is {_e(first.get('bound') or 'an upper bound')}; "
            f"{_e(first.get('upcast') or '')}. Model {_e(first.get('model'))}: "
            f"{_e(first.get('limits'))}; rings from {_e(first.get('source'))}; "
            f"docs/reduction-order.md</p>{rows}"
            + "".join(_one_prediction_html(x, len(ros) > 1) for x in ros))
