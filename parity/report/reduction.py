"""The reduction-order prediction (``parity diff --at``) on the console: the model, the
parameters at risk, what could not be predicted. From the JSON form (``reduction_order``), so a
sweep report can show it from a cell's stored diff."""

from __future__ import annotations

from rich import box
from rich.table import Table

from parity.consequences import reduction_phrase
from parity.report.text import T

MAX_ROWS = 12


def reduction_section(ro: dict | None) -> list:
    """Renderables for ``reduction_order`` (empty without a prediction)."""
    if not isinstance(ro, dict):
        return []
    style = {"differs": "bold red", "same": "green"}.get(ro.get("verdict"), "bold yellow")
    said = (reduction_phrase(ro) or "").removeprefix("reduction order ")
    out: list = [T("Reduction order ", "bold") + T(said, style)]
    topo = ro.get("topology") or {}
    out.append(T(f"  model {ro.get('model')} ({ro.get('limits')}); world {topo.get('world')}, "
                 f"channels {topo.get('channels') or 'derived per bucket size'}, protocol "
                 f"{topo.get('protocol')}, rings from {ro.get('source') or 'model'}; "
                 f"{ro.get('params_checked', 0)} parameters with another reduce-scatter layout "
                 f"checked (captured rank {ro.get('rank')})", "dim"))
    risk = [x for x in ro.get("at_risk") or [] if isinstance(x, dict)]
    if risk:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True)
        t.add_column("parameter at risk", overflow="fold", ratio=1)
        t.add_column("elements", justify="right", no_wrap=True)
        t.add_column("fraction", justify="right", no_wrap=True)
        t.add_column("RS bucket A / B", justify="right", no_wrap=True)
        t.add_column("why", no_wrap=True)
        shown = sorted(risk, key=lambda x: -(x.get("elements") or 0))[:MAX_ROWS]
        for x in shown:
            b = x.get("bucket") or {}
            fmt = lambda i: "-" if i is None else str(i)  # noqa: E731
            t.add_row(T(x.get("fqn")), T(f"{x.get('elements', 0):,}"),
                      T(f"{100 * (x.get('fraction') or 0):.1f}%"),
                      T(f"{fmt(b.get('a'))} / {fmt(b.get('b'))}"), T(x.get("why") or ""))
        out.append(t)
        if len(risk) > MAX_ROWS:
            out.append(T(f"  ... and {len(risk) - MAX_ROWS} more parameters at risk (--json "
                         "has all)", "dim"))
    for u in (ro.get("unpredicted") or [])[:MAX_ROWS]:
        out.append(T(f"  not predicted: reduce_scatter A#{u.get('a')} / B#{u.get('b')}: "
                     f"{u.get('reason')}", "yellow"))
    for n in ro.get("notes") or []:
        out.append(T(f"  note: {n}", "dim"))
    return out
