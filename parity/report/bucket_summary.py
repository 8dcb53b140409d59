"""Console rendering of the bucketing summary (parity/diff/bucket_summary.py): one run for
`parity inspect`, A and B side by side for `parity diff`.

The side-by-side table has a row per figure (not per column) so that it stays within 100
columns however many graphs a run has; a figure that differs between the sides is marked."""

from __future__ import annotations

from rich import box
from rich.table import Table

from parity.diff.bucket_summary import headline, pair_rows, side_label
from parity.report.text import T

MAX_ATTRIBUTION = 20
_ABBR = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A"}


def _count(row: dict | None) -> str:
    if row is None:
        return "-"
    before = row.get("count_before")
    return f"{before} -> {row['count_after']}" if isinstance(before, int) else str(row["count_after"])


def _bytes(row: dict | None) -> str:
    b = row.get("bytes") if row else None
    if not b:
        return "-"
    med = b["median"]
    med = int(med) if float(med).is_integer() else med
    return f"{b['min']}/{med}/{b['max']}"


def _around(row: dict | None) -> str:
    a = row.get("around_bucketing") if row else None
    return f"{a['before']} -> {a['after']}" if isinstance(a, dict) else "-"


def _num(value) -> str:
    return "-" if value is None else str(value)


_PAYLOAD_ABBR = {"parameter": "param", "activation": "act", "token": "token", "unknown": "?"}


def _payloads(row: dict | None) -> str:
    """``12 param, 2 act, 1 token``: the buckets by what they carry (compiled graphs)."""
    p = row.get("payloads") if row else None
    if not isinstance(p, dict) or not p:
        return "-"
    order = list(_PAYLOAD_ABBR)
    return ", ".join(f"{p[k]} {_PAYLOAD_ABBR.get(k, k)}"
                     for k in sorted(p, key=lambda k: order.index(k) if k in order else 9))


# The figures of a row that AutoParallel defines and parity's own ones, labelled so (the
# definitions: parity/diff/bucket_summary.py and docs/inspect.md).
FIGURE_COLUMNS = (
    ("max span at bucketing (AutoParallel)", "max_span_at_bucketing"),
    ("max span, pre-pass order (parity)", "max_span"),
    ("max compute btw RS (AutoParallel)", "max_consec_compute_between_rs"),
    ("max ops btw RS (parity)", "max_compute_between_rs"),
)


def _sorted_rows(summary: dict) -> list[dict]:
    order = {"all_gather": 0, "reduce_scatter": 1}
    phases = {"forward": 0, "backward": 1}
    return sorted(summary["graphs"], key=lambda r: (
        order.get(r["collective"], 2), -1 if r["graph_id"] is None else r["graph_id"],
        phases.get(r["graph"], 2)))


REGATHER_NOTE = ("eager FSDP2 all-gathers again in the backward (reshard_after_forward): "
                 "copies of the same parameters, values unchanged; not a difference")


def regather(pair: dict) -> bool:
    """A side-by-side row of backward all-gathers where a side is eager FSDP2: FSDP2 re-gathers
    the parameters it resharded after the forward (torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py, ``FSDPParamGroup.pre_backward`` -> ``unshard``, torch 2.13), a
    compiled graph keeps or recomputes them instead. Copies, never sums: its counts differ by
    design and are shown, not marked as a difference."""
    return pair.get("collective") == "all_gather" and pair.get("phase") == "backward" and any(
        (pair.get(k) or {}).get("source") == "fsdp2" for k in ("a", "b"))


def print_summary(summary: dict | None, console, title: str = "Bucketing") -> None:
    """One run: a row per graph and collective kind (counts, bytes, what the buckets carry),
    then, where recorded, the figures (AutoParallel's and parity's own), then attribution."""
    skipped = [str(m) for m in (summary or {}).get("skipped") or []]
    for m in skipped[:5]:  # damaged records, left out of what follows
        console.print(T(f"skipped (damaged): {m}"))
    if len(skipped) > 5:
        console.print(T(f"skipped (damaged): {len(skipped) - 5} more"))
    if not summary or not summary.get("graphs"):
        console.print(T("Bucketing: no bucket manifests recorded"))
        return
    console.print(T(f"{title} (rank {summary.get('rank', 0)}): {headline(summary)}"))
    rows = _sorted_rows(summary)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    around = any(isinstance(r.get("around_bucketing"), dict) for r in rows)
    payloads = any(isinstance(r.get("payloads"), dict) for r in rows)
    for col, just in (("graph", "left"), ("coll.", "left"), ("count", "right"),
                      *((("at bucketing", "right"),) if around else ()),
                      ("bytes min/median/max", "right"),
                      *((("buckets carry", "left"),) if payloads else ())):
        table.add_column(col, justify=just, no_wrap=True,
                         min_width=9 if col in ("count", "at bucketing") else None)
    for row in rows:
        table.add_row(T(side_label(row)), T(_ABBR.get(row["collective"], row["collective"])),
                      T(_count(row)), *((T(_around(row)),) if around else ()), T(_bytes(row)),
                      *((T(_payloads(row)),) if payloads else ()))
    console.print(table)
    figured = [r for r in rows if any(r.get(k) is not None for _, k in FIGURE_COLUMNS)]
    if figured:
        fig = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        fig.add_column("graph", no_wrap=True)
        fig.add_column("coll.", no_wrap=True)
        for label, _ in FIGURE_COLUMNS:
            fig.add_column(label, justify="right", max_width=14)
        for row in figured:
            fig.add_row(T(side_label(row)), T(_ABBR.get(row["collective"], row["collective"])),
                        *(T(_num(row.get(k))) for _, k in FIGURE_COLUMNS))
        console.print(fig)
    print_attribution(summary.get("attribution") or [], console)


def attribution_line(a: dict) -> str:
    where = a.get("graph") or a.get("source")
    return (f"{a['fqn']} ({a['collective']}, {where}) issued under module {a['module']!r}, "
            f"not its owner {a['owner'] or '(root)'!r}")


def print_attribution(rows: list[dict], console, side: str = "") -> None:
    prefix = f"{side}: " if side else ""
    for a in rows[:MAX_ATTRIBUTION]:
        console.print(T(prefix + attribution_line(a)))
    if len(rows) > MAX_ATTRIBUTION:
        console.print(T(f"{prefix}... and {len(rows) - MAX_ATTRIBUTION} more parameters issued "
                        "outside their owner"))


FIGURES = (
    ("count before -> after", _count),
    ("around bucketing pass", _around),
    ("bytes min/med/max", _bytes),
    ("buckets carry", _payloads),
    *((label, (lambda k: lambda r: _num(r and r.get(k)))(key)) for label, key in FIGURE_COLUMNS),
)
# figures a side may not know (no pre-pass graph, no inductor bucketing): "-" is no finding
_OPTIONAL_FIGURES = ("around bucketing pass", "buckets carry", *(lbl for lbl, _ in FIGURE_COLUMNS))


def moved_line(m: dict, limit: int = 3) -> str:
    names = ", ".join(m["fqns"][:limit]) + (f" (+{len(m['fqns']) - limit} more)"
                                            if len(m["fqns"]) > limit else "")
    n = len(m["fqns"])
    return (f"{m['collective']}: {n} parameter{'s' if n > 1 else ''} in the bucket of "
            f"{m['a_module'] or '(root)'!r} in A, of {m['b_module'] or '(root)'!r} in B: {names}")


def print_moved(moved: list[dict], console) -> None:
    for m in moved[:MAX_ATTRIBUTION]:
        console.print(T("moved: " + moved_line(m)))
    if len(moved) > MAX_ATTRIBUTION:
        console.print(T(f"moved: ... and {len(moved) - MAX_ATTRIBUTION} more"))


def print_summary_pair(a: dict | None, b: dict | None, console, moved: list | None = None) -> None:
    """A and B side by side: per collective kind and phase, one line per figure; "*" marks a
    figure whose values differ."""
    if not (a and a.get("graphs")) and not (b and b.get("graphs")):
        return
    none = "no buckets recorded"
    console.print(T(f"Bucketing: A {headline(a) or none} | B {headline(b) or none}"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("collective", no_wrap=True)
    table.add_column("figure", no_wrap=True)
    table.add_column("A", justify="right", no_wrap=True)
    table.add_column("B", justify="right", no_wrap=True)
    table.add_column("", width=1)
    said_regather = False
    for pair in pair_rows(a, b):
        ra, rb = pair["a"], pair["b"]
        harmless = regather(pair)
        table.add_row(T(f"{_ABBR.get(pair['collective'], pair['collective'])} ({pair['phase']})"), T("graph"),
                      T(side_label(ra)), T(side_label(rb)), T(""))
        for name, fmt in FIGURES:
            va, vb = fmt(ra), fmt(rb)
            if name in _OPTIONAL_FIGURES and va == vb == "-":
                continue
            # a span or gap one side cannot know is no finding
            differs = va != vb and (name.startswith(("count", "bytes", "buckets"))
                                    or "-" not in (va, vb))
            if differs and harmless:
                said_regather = True
                table.add_row(T(""), T(name), T(va), T(vb), T("~", "dim"))
                continue
            table.add_row(T(""), T(name), T(va), T(vb), T("*" if differs else "", "bold red"))
    if said_regather:
        table.caption = f"* differs   ~ {REGATHER_NOTE}"
        table.caption_justify = "left"
    console.print(table)
    print_attribution((a or {}).get("attribution") or [], console, "A")
    print_attribution((b or {}).get("attribution") or [], console, "B")
    print_moved(moved or [], console)
