"""The reduction-order prediction (``parity diff --at``) on the console: one row per topology,
what the number is, and the reasoning per differing bucket (bytes per rank at the target, the
channels and protocols assumed, the ring family), the parameters at risk, what could not be
predicted or known, and, for an emulated pair, predicted against observed. From the JSON form
(``reduction_order``: one object, or a list for several topologies), so a sweep report can show
it from a cell's stored diff."""

from __future__ import annotations

from rich import box
from rich.table import Table

from parity.consequences import predictions, reduction_phrase
from parity.report.text import T

MAX_ROWS = 12
_STYLE = {"differs": "bold red", "same": "green"}
_WORD = {"differs": "at risk", "same": "same sums", "unknown": "unknown"}


def _mib(n) -> str:
    if not isinstance(n, int):
        return "-"
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB" if n >= 2**10 \
        else f"{n} B"


def _unknown_reason(x: dict) -> str:
    u = [v for v in x.get("unknown") or [] if isinstance(v, dict)]
    p = [v for v in x.get("unpredicted") or [] if isinstance(v, dict)]
    return str((u or p or [{}])[0].get("reason") or "")


def topology_rows(ros: list[dict]) -> Table:
    """One row per topology: verdict, elements and parameters at risk, why unknown."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True)
    t.add_column("topology", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("elements at risk", justify="right", no_wrap=True)
    t.add_column("parameters", justify="right", no_wrap=True)
    t.add_column("buckets differing", justify="right", no_wrap=True)
    t.add_column("unknown / not predicted", overflow="fold", ratio=1)
    for x in ros:
        v = x.get("verdict")
        risk = [r for r in x.get("at_risk") or [] if isinstance(r, dict)]
        bk = [b for b in x.get("buckets") or [] if isinstance(b, dict) and b.get("elements")]
        n_u = len(x.get("unknown") or []) + len(x.get("unpredicted") or [])
        t.add_row(T((x.get("topology") or {}).get("spec")), T(_WORD.get(v, str(v)),
                                                              _STYLE.get(v, "bold yellow")),
                  T(f"{sum(int(r.get('elements') or 0) for r in risk):,}"), T(f"{len(risk)}"),
                  T(f"{len(bk)}"),
                  T(f"{n_u}: {_unknown_reason(x)}" if n_u else "", "yellow"))
    return t


def _span(values) -> str:
    vs = sorted({v for v in values if isinstance(v, int)})
    if not vs:
        return "-"
    return str(vs[0]) if len(vs) == 1 else f"{vs[0]}-{vs[-1]}"


def _bucket_facts(b: dict) -> tuple[str, str, str, str]:
    """(bytes per rank, protocols, channels A / B of the communicator's, ring families)."""
    scen = [s for s in b.get("scenarios") or [] if isinstance(s, dict)]
    by = b.get("bytes_per_rank") or {}
    size = _mib(by.get("a")) if by.get("a") == by.get("b") else \
        f"{_mib(by.get('a'))} / {_mib(by.get('b'))}"
    protos = ", ".join(sorted({str(s.get("protocol")) for s in scen}))
    ch = (f"{_span((s.get('channels') or {}).get('a') for s in scen)} / "
          f"{_span((s.get('channels') or {}).get('b') for s in scen)} of "
          f"{_span(s.get('comm_channels') for s in scen)}")
    fams = ", ".join(dict.fromkeys(f for s in scen for f in str(s.get("family")).split("+")))
    return size, protos, ch, fams


def bucket_rows(x: dict) -> list:
    """The reasoning per differing reduction bucket pair at one topology: a table, and the ring
    families once (every bucket of a topology is tried on the same ones)."""
    bk = [b for b in x.get("buckets") or [] if isinstance(b, dict)]
    if not bk:
        return []
    spec = (x.get("topology") or {}).get("spec")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True,
              title=T(f"at {spec}, per differing bucket", "dim"), title_justify="left")
    t.add_column("bucket A / B", no_wrap=True)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("group", no_wrap=True)
    t.add_column("bytes/rank", justify="right", no_wrap=True)
    t.add_column("protocols", overflow="fold")
    t.add_column("channels A / B", no_wrap=True)
    t.add_column("at risk", justify="right", no_wrap=True)
    bk.sort(key=lambda b: -(b.get("elements") or 0))
    families: dict[str, None] = {}
    for b in bk[:MAX_ROWS]:
        size, protos, ch, fams = _bucket_facts(b)
        families.update(dict.fromkeys(f for f in fams.split(", ") if f))
        short = {"reduce_scatter": "RS", "all_reduce": "AR"}.get(b.get("collective"),
                                                                  b.get("collective"))
        t.add_row(T(f"{short} {b.get('a')} / {b.get('b')}"),
                  T("-" if b.get("step") is None else str(b.get("step"))), T(b.get("group")),
                  T(size), T(protos), T(ch),
                  T(f"{b.get('elements') or 0:,}", "red" if b.get("elements") else "green"))
    if len(bk) > MAX_ROWS:
        t.caption = f"... and {len(bk) - MAX_ROWS} more buckets (--json has all)"
    return [t, T(f"  ring families tried at {spec}: {', '.join(families)}", "dim")]


def risk_rows(x: dict) -> list:
    risk = [r for r in x.get("at_risk") or [] if isinstance(r, dict)]
    if not risk:
        return []
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True)
    t.add_column("parameter at risk", overflow="fold", ratio=1)
    t.add_column("elements", justify="right", no_wrap=True)
    t.add_column("fraction", justify="right", no_wrap=True)
    t.add_column("bucket A / B", justify="right", no_wrap=True)
    t.add_column("why", no_wrap=True)
    shown = sorted(risk, key=lambda r: -(r.get("elements") or 0))[:MAX_ROWS]
    for r in shown:
        b = r.get("bucket") or {}
        fmt = lambda i: "-" if i is None else str(i)  # noqa: E731
        t.add_row(T(r.get("fqn")), T(f"{r.get('elements', 0):,}"),
                  T(f"{100 * (r.get('fraction') or 0):.1f}%"),
                  T(f"{b.get('collective', '')} {fmt(b.get('a'))} / {fmt(b.get('b'))}"),
                  T(r.get("why") or ""))
    out: list = [t]
    if len(risk) > MAX_ROWS:
        out.append(T(f"  ... and {len(risk) - MAX_ROWS} more parameters at risk (--json "
                     "has all)", "dim"))
    return out


def reduction_section(ro) -> list:
    """Renderables for ``reduction_order`` (empty without a prediction)."""
    ros = predictions(ro)
    if not ros:
        return []
    verdicts = {x.get("verdict") for x in ros}
    worst = "differs" if "differs" in verdicts else "unknown" if verdicts - {"same"} else "same"
    said = (reduction_phrase(ro) or "").removeprefix("reduction order ")
    out: list = [T("Reduction order ", "bold") + T(said, _STYLE.get(worst, "bold yellow"))]
    first = ros[0]
    out.append(T(f"  model {first.get('model')} ({first.get('limits')}); "
                 f"{first.get('params_checked', 0)} parameters with another reduction layout "
                 f"checked (captured rank {first.get('rank')}, steps "
                 f"{', '.join(map(str, first.get('steps') or [])) or '-'}), rings from "
                 f"{first.get('source') or 'model'}", "dim"))
    if worst == "differs":
        out.append(T(f"  at risk is {first.get('bound') or 'an upper bound'}; "
                     f"{first.get('upcast') or ''}", "dim"))
    if len(ros) > 1:
        out.append(topology_rows(ros))
    for x in ros:
        out += bucket_rows(x)
    lead = next((x for x in ros if x.get("at_risk")), None)
    if lead is not None:
        if len(ros) > 1:
            out.append(T(f"  parameters at risk at {(lead.get('topology') or {}).get('spec')}:",
                         "dim"))
        out += risk_rows(lead)
    for x in ros:
        spec = (x.get("topology") or {}).get("spec")
        for u in (x.get("unknown") or [])[:MAX_ROWS]:
            out.append(T(f"  unknown at {spec}: {u.get('collective')} A#{u.get('a')} / "
                         f"B#{u.get('b')}: {u.get('reason')}", "yellow"))
        for u in (x.get("unpredicted") or [])[:MAX_ROWS]:
            out.append(T(f"  not predicted at {spec}: {u.get('collective')} A#{u.get('a')} / "
                         f"B#{u.get('b')}: {u.get('reason')}", "yellow"))
        obs = x.get("observed")
        if isinstance(obs, dict):
            missed = obs.get("not_predicted") or []
            out.append(T(f"  predicted vs observed at {spec} (emulated): {obs.get('predicted')} "
                         f"parameters predicted at risk, {obs.get('diverged')} gradients "
                         f"diverged at step {obs.get('step')}, {obs.get('both')} both"
                         + (f"; NOT predicted: {', '.join(map(str, missed[:5]))}" if missed
                            else ""), "red" if missed else "dim"))
        elif x.get("emulated"):
            out.append(T(f"  hashes compared under emulation at {x.get('emulated')}; predicted "
                         f"at {spec}", "dim"))
    seen: set = set()
    for x in ros:
        for a in [*(x.get("assumptions") or []), *(x.get("notes") or [])]:
            if a not in seen:
                seen.add(a)
                out.append(T(f"  note: {a}", "dim"))
    return out
