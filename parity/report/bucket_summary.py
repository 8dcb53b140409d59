"""Console rendering of the bucketing summary (parity/bucket_summary.py): one run for
`parity inspect`, A and B side by side for `parity diff`."""

from __future__ import annotations

from rich.table import Table

from parity.report.console import T


def _graph_label(row: dict) -> str:
    if row["source"] == "graph":
        return f"{row['graph']} #{row['graph_id']}"
    return {"fsdp2": "eager FSDP2", "dtensor": "eager DTensor"}.get(row["source"], str(row["source"]))


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
    return f"{b['min']} / {med} / {b['max']}"


def _num(value) -> str:
    return "-" if value is None else str(value)


def _key(row: dict) -> tuple:
    return (row["source"], row["graph"] or "", -1 if row["graph_id"] is None else row["graph_id"],
            row["collective"])


def print_summary(summary: dict | None, console, title: str = "Bucketing") -> None:
    """One run: a row per graph and collective kind, then the attribution lines."""
    if not summary or not summary.get("graphs"):
        console.print(T("bucketing: no bucket manifests recorded"))
        return
    table = Table(title=f"{title} (rank {summary.get('rank', 0)})", title_justify="left")
    for col in ("graph", "collective", "count before -> after", "bytes min / median / max",
                "max span", "max compute between RS"):
        table.add_column(col)
    for row in summary["graphs"]:
        table.add_row(T(_graph_label(row)), T(row["collective"]), T(_count(row)), T(_bytes(row)),
                      T(_num(row["max_span"])), T(_num(row["max_consec_compute_between_rs"])))
    console.print(table)
    print_attribution(summary.get("attribution") or [], console)


def print_attribution(rows: list[dict], console, side: str = "") -> None:
    prefix = f"{side}: " if side else ""
    for a in rows[:20]:
        where = a["graph"] or a["source"]
        console.print(T(f"{prefix}{a['fqn']} ({a['collective']}, {where}) issued under module "
                        f"{a['module']!r}, not its owner {a['owner'] or '(root)'!r}"))
    if len(rows) > 20:
        console.print(T(f"{prefix}... and {len(rows) - 20} more parameters issued outside their owner"))


def print_summary_pair(a: dict | None, b: dict | None, console) -> None:
    """A and B side by side: counts, bytes, spans and compute between RS per graph/collective."""
    if not (a and a.get("graphs")) and not (b and b.get("graphs")):
        return
    rows_a = {_key(r): r for r in (a or {}).get("graphs", [])}
    rows_b = {_key(r): r for r in (b or {}).get("graphs", [])}
    table = Table(title="Bucketing (A vs B)", title_justify="left")
    for col in ("graph", "collective", "count A", "count B", "bytes A", "bytes B",
                "max span A / B", "max compute between RS A / B"):
        table.add_column(col)
    keys = sorted(set(rows_a) | set(rows_b), key=lambda k: tuple(str(x) for x in k))
    for k in keys:
        ra, rb = rows_a.get(k), rows_b.get(k)
        any_row = ra or rb
        table.add_row(
            T(_graph_label(any_row)), T(any_row["collective"]), T(_count(ra)), T(_count(rb)),
            T(_bytes(ra)), T(_bytes(rb)),
            T(f"{_num(ra and ra['max_span'])} / {_num(rb and rb['max_span'])}"),
            T(f"{_num(ra and ra['max_consec_compute_between_rs'])} / "
              f"{_num(rb and rb['max_consec_compute_between_rs'])}"))
    console.print(table)
    print_attribution((a or {}).get("attribution") or [], console, "A")
    print_attribution((b or {}).get("attribution") or [], console, "B")
