"""From what the ranks measured to ``DIR/topology.json``, the agreement figures and the report.

Rank 0 runs this at the end of a probe (parity.probe.rank); ``parity nccl-probe --report DIR``
reads it back. For every case:

* what NCCL ran: the TUNING line rank 0's log printed for each of the case's calls (rank 0 of a
  communicator prints them, ``scheduleCollTasksToPlan`` in ``src/enqueue.cc``), matched to the
  probe's own record of its calls in issue order (a row matches a call of its collective and
  bytes: ``TuningRow.matches``). Emulated: Ring, under the protocol the emulation ran.
* its status:
  - ``not modelled``: NCCL ran another algorithm than Ring (NVLS, PAT, Tree, CollNet), or no
    TUNING line says what ran and no Ring protocol reproduces the bits; never counted as
    agreement;
  - ``agree``: Ring, and every element every rank checked has the model's bits under the
    protocol NCCL ran (or, not logged, under some protocol);
  - ``differs``: Ring, and some element does not.
* repeats (the same inputs, ``--repeat`` times) and, for an all-reduce, the ranks' full results
  compared by digest: said when they differ (NVLS is documented not to repeat).

The agreement figure is agree / (agree + differs): the fraction of modelled cases NCCL computed
bit for bit as the model says. The topology file is the topology the model was checked at (the
rings every rank printed, the channel count, the NCCL release) plus the TUNING rows of the
probe's calls (a later prediction of a bucket of exactly a probed size uses NCCL's logged
choice) and the ``probe`` section parity.nccl.probe_file reads.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import replace
from pathlib import Path

from parity.artifacts import write_json_atomic
from parity.errors import EXIT_INCOMPLETE, EXIT_OK, EXIT_MISMATCH, ParityError
from parity.nccl import (MODEL, Topology, TuningRow, predict, read_log, rules_for,
                         save_topology)
from parity.nccl.probe_file import PROBE_KEY
from parity.probe import cases as pc
from parity.probe.cluster import describe
from parity.probe.files import LOGS_DIR, PROBE_FILE, REPORT_FILE, TOPOLOGY_FILE, log_name

AGREE, DIFFERS, NOT_MODELLED = "agree", "differs", "not modelled"
RING = "RING"


# ------------------------------------------------------------------------------ TUNING rows


def tuning_rows(out: Path, record: dict) -> tuple[list[TuningRow], list[str]]:
    """Rank 0's TUNING rows of the world communicator, in log order (NCCL runs only)."""
    if record.get("emulate"):
        return [], []
    path = out / LOGS_DIR / log_name(0)
    if not path.exists():
        return [], [f"rank 0's NCCL log {path} is missing: what NCCL ran is not known"]
    try:
        comm = read_log([path]).select()
    except ParityError as e:
        return [], [f"rank 0's NCCL log could not be read: {e}"]
    rows = list(comm.tuning)
    if not rows:
        return [], ["rank 0's NCCL log has no TUNING line (NCCL before 2.20, or "
                    "NCCL_DEBUG_SUBSYS without TUNING): what NCCL ran is inferred"]
    return rows, []


def match_calls(calls: list[dict], rows: list[TuningRow], world: int) -> list[TuningRow | None]:
    """The TUNING row of each call, in order: the next unused row of that collective and size
    (rows the probe did not cause, e.g. an object collective's, are skipped)."""
    out: list[TuningRow | None] = []
    j = 0
    for call in calls:
        k = j
        while k < len(rows) and not rows[k].matches(call["kind"], call["count"],
                                                     call["elem_size"], world):
            k += 1
        if k < len(rows):
            out.append(rows[k])
            j = k + 1
        else:
            out.append(None)
    return out


# ---------------------------------------------------------------------------- per case


def _span(channels) -> list[int] | None:
    return [min(channels), max(channels)] if channels else None


def judge_case(case: pc.Case, per_rank: list[dict], rows: list[TuningRow | None],
               record: dict, cluster: Topology) -> dict:
    """One case's outcome (see the module docstring)."""
    world = record["world"]
    emulated = bool(record.get("emulate"))
    logged = [r for r in rows if r is not None]
    row = logged[0] if logged else None
    notes = []
    if len({(r.algorithm, r.protocol, r.channel_lo, r.channel_hi) for r in logged}) > 1:
        notes.append("NCCL chose differently between repeats: "
                     + "; ".join(f"{r.algorithm} {r.protocol}" for r in logged))
    variants = per_rank[0]["variants"]
    algorithm, protocol, source, reason = None, None, None, None
    if emulated:
        algorithm, protocol, source = RING, next(iter(variants)), "emulated"
    elif row is not None:
        algorithm, protocol, source = row.algorithm, row.protocol, "log"
    if algorithm is not None and algorithm != RING:
        status, reason = NOT_MODELLED, f"NCCL ran {algorithm} (the model is Ring only)"
        chosen = None
    elif protocol is not None:
        chosen = protocol if protocol in variants else None
        if chosen is None:
            status, reason = NOT_MODELLED, f"protocol {protocol} was not emulated"
        else:
            status = AGREE if all(r["variants"][chosen]["mismatches"] == 0
                                  for r in per_rank) else DIFFERS
    else:  # NCCL ran it, no TUNING line says how
        agreeing = [p for p in variants
                    if all(r["variants"][p]["mismatches"] == 0 for r in per_rank)]
        p = predict(cluster, case.collective, case.count, case.elem_size, op=case.op,
                    env=(record.get("cluster") or {}).get("env"))
        if agreeing:
            chosen, status, source = agreeing[0], AGREE, "not logged"
            notes.append(f"no TUNING line: the bits are Ring {', '.join(agreeing)}'s")
        elif hasattr(p, "reason"):
            chosen, status = None, NOT_MODELLED
            reason = f"no TUNING line, and {p.reason}; no Ring protocol reproduces the bits"
        else:
            chosen, status, source = _fallback_protocol(variants), DIFFERS, "not logged"
            notes.append("no TUNING line: compared under every protocol, none agrees")
    elements = sum(r["share"][1] - r["share"][0] for r in per_rank)
    mismatches = (sum(r["variants"][chosen]["mismatches"] for r in per_rank)
                  if chosen else None)
    model_channels = _span(sorted({c for r in per_rank
                                   for c in (r["variants"][chosen]["channels"] if chosen else [])}))
    nccl_channels = ([row.channel_lo, row.channel_hi]
                     if row is not None and row.channel_lo is not None else None)
    repeatable = all(len(set(r["digests"])) == 1 for r in per_rank)
    ranks_agree = (len({r["digests"][0] for r in per_rank}) == 1
                   if case.collective == pc.ALL_REDUCE else None)
    if not repeatable:
        notes.append("the output changed between repeats of the same inputs")
    if ranks_agree is False:
        notes.append("the ranks hold different all-reduce results")
    first = None
    if status == DIFFERS and chosen:
        for r in per_rank:
            v = r["variants"][chosen]
            if v["mismatches"]:
                first = v["diagnosis"]
                break
    return {"case": case.index, "label": case.label(world), "collective": case.collective,
            "op": case.op, "dtype": case.dtype, "count": case.count,
            "bytes": case.input_bytes(world), "origin": case.origin, "status": status,
            "reason": reason, "algorithm": algorithm, "protocol": chosen or protocol,
            "protocol_source": source, "nccl_channels": nccl_channels,
            "model_channels": model_channels,
            "channels_agree": (None if nccl_channels is None or model_channels is None
                               else nccl_channels == model_channels),
            "tuning_lines": [r.line for r in logged], "elements": elements,
            "mismatches": mismatches, "repeatable": repeatable, "ranks_agree": ranks_agree,
            "first": first, "notes": notes}


def _fallback_protocol(variants: dict) -> str:
    """The protocol a disagreement is reported under when no TUNING line names one."""
    return "Simple" if "Simple" in variants else next(iter(variants))


# ------------------------------------------------------------------------------ the whole


def analyse(out: Path, record: dict) -> dict:
    """Every case judged, the figures, the cluster, the topology to save."""
    world = record["world"]
    cases = [pc.Case.from_dict(c) for c in record["cases"]]
    plan = record["plan"]
    cluster_topo = Topology.from_dict(plan["cluster"])
    checked = Topology.from_dict(plan["checked"])
    logs = {}
    for m in record["ranks"]:
        p = out / LOGS_DIR / log_name(m["rank"])
        if p.exists():
            try:
                logs[m["rank"]] = p.read_text(errors="replace")
            except OSError:
                pass
    machines = describe(record["ranks"], logs)
    record["cluster"] = machines
    rows, notes = tuning_rows(out, record)
    matched = match_calls(record["calls"], rows, world)
    per_case: dict[int, list] = {c.index: [] for c in cases}
    for call, row in zip(record["calls"], matched):
        what = call.get("what", "")
        if what.startswith("case "):
            per_case[int(what.split()[1])].append(row)
    judged = [judge_case(c, record["results"][k], per_case[c.index], record, cluster_topo)
              for k, c in enumerate(cases)]
    figures = _figures(judged)
    topo, tuning_notes = _file_topology(checked, judged, rows, matched, record, machines)
    notes.extend(tuning_notes)
    return {"cases": judged, "agreement": figures, "machines": machines, "notes": notes,
            "topology": topo.to_dict(), "plan_notes": plan.get("notes") or []}


def _figures(judged: list[dict]) -> dict:
    agree = sum(j["status"] == AGREE for j in judged)
    differ = sum(j["status"] == DIFFERS for j in judged)
    nm = sum(j["status"] == NOT_MODELLED for j in judged)
    modelled = agree + differ
    elements = sum(j["elements"] for j in judged if j["mismatches"] is not None)
    bad = sum(j["mismatches"] or 0 for j in judged)
    first = next((j for j in judged if j["status"] == DIFFERS), None)
    return {"cases": len(judged), "modelled": modelled, "agree": agree, "differ": differ,
            "not_modelled": nm,
            "percent": round(100.0 * agree / modelled, 2) if modelled else None,
            "elements": elements, "elements_differ": bad,
            "repeatable": sum(j["repeatable"] for j in judged),
            "channels_checked": sum(j["channels_agree"] is not None for j in judged),
            "channels_agree": sum(bool(j["channels_agree"]) for j in judged),
            "first_disagreement": first["case"] if first else None}


def summary_line(fig: dict, record: dict, topo: dict) -> str:
    """The one line a report that uses the topology file prints."""
    pct = "n/a (no modelled case)" if fig["percent"] is None else f"{fig['percent']:.1f}%"
    where = ("emulated " + str(record.get("emulate")) if record.get("emulate")
             else "NCCL " + ", ".join((record.get("cluster") or {}).get("nccl_versions") or ["?"]))
    return (f"agreement {pct}: {fig['agree']} of {fig['modelled']} modelled cases bit-identical, "
            f"{fig['not_modelled']} not modelled ({where}, {topo['nodes']}x{topo['gpus']}, "
            f"probed {_date(record.get('ended'))})")


def _date(ts) -> str:
    if not isinstance(ts, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d")


def _file_topology(checked: Topology, judged: list[dict], rows: list[TuningRow], matched,
                   record: dict, machines: dict) -> tuple[Topology, list[str]]:
    """The checked topology, with the TUNING rows of the probe's calls (a size whose rows
    disagree, e.g. NVLS for SUM and Ring for AVG, is left out: a prediction cannot tell the op)
    and the NIC count."""
    notes = []
    keep: dict[tuple, TuningRow] = {}
    dropped: set[tuple] = set()
    for call, row in zip(record["calls"], matched):
        if row is None or not str(call.get("what", "")).startswith("case "):
            continue
        key = (row.collective, row.nbytes, row.per_rank)
        old = keep.get(key)
        same = (lambda a, b: (a.algorithm, a.protocol, a.channel_lo, a.channel_hi)
                == (b.algorithm, b.protocol, b.channel_lo, b.channel_hi))
        if old is not None and not same(old, row):
            dropped.add(key)
        keep.setdefault(key, row)
    for key in sorted(dropped, key=str):
        keep.pop(key, None)
        notes.append(f"{key[0]} of {pc.human_bytes(key[1])}: NCCL's choice depended on the op "
                     "or dtype; its TUNING row is not kept in the topology file")
    tuning = tuple(sorted(keep.values(), key=lambda r: (str(r.collective), r.nbytes))) or None
    nics = checked.nics
    n = machines.get("nics_per_host")
    if nics is None and n and not record.get("emulate") and 1 <= n <= max(64, checked.gpus):
        nics = n
    return replace(checked, tuning=tuning, nics=nics, source=None), notes


def verdict_code(fig: dict) -> int:
    """0: every modelled case agrees; 1: one does not (the model does not hold on this
    cluster); 3: no case could be checked."""
    if fig["differ"]:
        return EXIT_MISMATCH
    if not fig["modelled"]:
        return EXIT_INCOMPLETE
    return EXIT_OK


# ----------------------------------------------------------------------------- writing


def analyse_and_report(out: Path, record: dict) -> int:
    """Rank 0: analyse, write probe.json, topology.json, report.txt, print the report. Returns
    0 (the ranks' exit code: the probe ran; ``--report DIR`` gives the verdict's)."""
    result = analyse(out, record)
    fig = result["agreement"]
    topo = Topology.from_dict(result["topology"])
    section = {"format": record["format"], "agreement": fig,
               "summary": summary_line(fig, record, result["topology"]),
               "first_disagreement": first_text(result),
               "backend": record["backend"], "emulate": record.get("emulate"),
               "model": MODEL, "rules": _rules(topo),
               "nccl": ", ".join(result["machines"]["nccl_versions"]) or None,
               "checked": record.get("model") or record.get("emulate")
               or "the cluster's (rebuilt from its NCCL logs)",
               "probed": _date(record.get("ended")), "probe_file": PROBE_FILE,
               "choices": [{k: j[k] for k in ("collective", "op", "dtype", "bytes", "algorithm",
                                             "protocol", "nccl_channels", "model_channels",
                                             "status")} for j in result["cases"]]}
    record["analysis"] = result
    write_json_atomic(out / PROBE_FILE, record)
    save_topology(topo, out / TOPOLOGY_FILE,
                  extra={PROBE_KEY: section, "cluster": result["machines"]})
    lines = report_lines(record, result, out)
    (out / REPORT_FILE).write_text("\n".join(lines) + "\n")
    try:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    return EXIT_OK


def _rules(topo: Topology) -> str:
    r = rules_for(topo.nccl)
    return f"nccl-{r.family}" if r else f"none for NCCL {topo.nccl}"


def load(out: str | os.PathLike) -> dict:
    """A finished probe's record (``DIR/probe.json``), for ``--report``."""
    import json

    p = Path(out) / PROBE_FILE
    try:
        rec = json.loads(p.read_text())
    except OSError as e:
        raise ParityError(f"nccl-probe --report: cannot read {p} ({e.strerror or e}); is "
                          f"{out} a probe directory?") from None
    except ValueError as e:
        raise ParityError(f"nccl-probe --report: {p} is not JSON ({e})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("analysis"), dict):
        raise ParityError(f"nccl-probe --report: {p} holds no analysis (the probe did not "
                          "finish)")
    return rec


# ------------------------------------------------------------------------------ the report


def first_text(result: dict) -> str | None:
    """The first disagreeing case in words (None when every modelled case agrees)."""
    j = next((j for j in result["cases"] if j["status"] == DIFFERS), None)
    if j is None:
        return None
    d = j.get("first") or {}
    found = d.get("reproduced_by") or {}
    named = found.get("named") or []
    orders = found.get("orders") or []
    shown = [f"{n} (order {' '.join(map(str, orders[k]))})" if k < len(orders) else n
             for k, n in enumerate(named[:2])]
    how = ("reproduced by " + "; ".join(shown)
           + (f" (and {len(named) - 2} more)" if len(named) > 2 else "")
           if named else
           f"reproduced by the order {' '.join(map(str, found['orders'][0]))}"
           if found.get("orders") else
           f"no order of the {len(d.get('inputs') or [])} inputs tried ({found.get('tried', 0)}"
           f"{', every order' if found.get('exhaustive') else ''}) reproduces it")
    return (f"{j['label']} (case {j['case']}, {j['protocol']}): rank {d.get('rank')}, element "
            f"{d.get('element')} ({d.get('where')}): the model sums it on channel "
            f"{d.get('channel')} in rank order {' '.join(map(str, d.get('expected_order') or []))}"
            f" -> {d.get('expected')} ({d.get('expected_value')!r}); NCCL gave "
            f"{d.get('observed')} ({d.get('observed_value')!r}), {how}")


def _cell(group: list[dict]) -> str:
    """One table cell: the ops of one collective, dtype and size."""
    st = {j["status"] for j in group}
    if st == {AGREE}:
        word = "ok"
    elif DIFFERS in st:
        bad = [j["op"] for j in group if j["status"] == DIFFERS]
        word = "DIFF" if len(bad) == len(group) else "DIFF " + ",".join(bad)
    elif st == {NOT_MODELLED}:
        algos = sorted({(j["algorithm"] or "?").lower() for j in group})
        word = "n/m " + ",".join(algos)
    else:
        word = "ok/n-m"
    j = group[0]
    chans = j["model_channels"]
    ch = "" if not chans else (f" c{chans[1] - chans[0] + 1}" if chans[0] == 0
                               else f" c{chans[0]}..{chans[1]}")
    if j["channels_agree"] is False:
        n = j["nccl_channels"]
        ch += f"!={n[1] - n[0] + 1}"
    proto = {"Simple": " S", "LL": " LL", "LL128": " LL128"}.get(j["protocol"] or "", "")
    rep = "" if all(g["repeatable"] for g in group) else " !rep"
    return word + ch + proto + rep


def table_lines(judged: list[dict]) -> list[str]:
    """The agreement grid: one row per size, one column per collective and dtype."""
    cols = []
    for coll in pc.COLLECTIVES:
        for dt in pc.DTYPES:
            if any(j["collective"] == coll and j["dtype"] == dt for j in judged):
                cols.append((coll, dt))
    sizes = sorted({j["bytes"] for j in judged})
    cell: dict[tuple, list] = {}
    for j in judged:
        cell.setdefault((j["bytes"], j["collective"], j["dtype"]), []).append(j)
    text = {k: _cell(v) for k, v in cell.items()}
    width = max([len("reduce-scatter") + 2] + [len(t) + 2 for t in text.values()])
    head1 = f"{'input/rank':<11}" + "".join(f"{c.replace('_', '-'):<{width}}" for c, _ in cols)
    head2 = f"{'':<11}" + "".join(f"{pc.SHORT[d]:<{width}}" for _, d in cols)
    lines = [head1.rstrip(), head2.rstrip()]
    for s in sizes:
        row = f"{pc.human_bytes(s):<11}"
        for c, d in cols:
            row += f"{text.get((s, c, d), '-'):<{width}}"
        lines.append(row.rstrip())
    return lines


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def report_lines(record: dict, result: dict, out: Path) -> list[str]:
    fig = result["agreement"]
    m = result["machines"]
    topo = result["topology"]
    plan = record["plan"]
    world = record["world"]
    emulated = bool(record.get("emulate"))
    where = (f"emulated cluster {record['emulate']} on gloo" if emulated else
             f"NCCL {', '.join(m['nccl_versions']) or '?'} on {m['host_count']} host(s)"
             + (f" ({', '.join(m['gpu_models'])})" if m["gpu_models"] else ""))
    lines = [f"parity nccl-probe: {world} ranks, {where}; {fig['cases']} cases x "
             f"{record['repeat']} repeats, seed {record['seed']}"]
    if not emulated:
        nic = (f"{m['nics_per_host']} NIC(s) per host" if m["nics_per_host"]
               else "NICs not printed")
        lines.append(f"  cluster: {topo['nodes']} node(s) x {topo['gpus']} GPU(s), {nic}"
                     + (f" ({', '.join(m['networks'])})" if m["networks"] else ""))
    if emulated:
        lines.append("  the cluster is parity's own emulation: agreement at the emulated topology "
                     "checks the probe, not NCCL")
    rings = topo.get("rings") or []
    lines.append(f"  checked at: {topo['nodes']}x{topo['gpus']}, {len(rings)} channel(s), "
                 f"model {MODEL}, rules {_rules(Topology.from_dict(topo))}"
                 + ("" if topo.get("nccl") else " (no NCCL version: the newest modelled)"))
    for c, ring in enumerate(rings[:8]):  # read from rank 0, as NCCL prints them
        z = ring.index(0) if 0 in ring else 0
        lines.append(f"    channel {c:>2}: {' '.join(map(str, ring[z:] + ring[:z]))}")
    if len(rings) > 8:
        lines.append(f"    ... {len(rings) - 8} more channels (topology.json has every ring)")
    for n in plan.get("notes") or []:
        lines.append(f"  note: {n}")
    lines.append("")
    lines.extend(table_lines(result["cases"]))
    lines.append("  ok: every element has the model's bits; DIFF: some do not; n/m: not modelled "
                 "(NCCL ran that algorithm)")
    lines.append("  cN: channels the model used (!=M: NCCL's TUNING line says M); S/LL/LL128: the "
                 "protocol NCCL ran; !rep: a repeat gave other bits")
    lines.append("")
    for j in result["cases"]:
        if j["status"] == NOT_MODELLED:
            lines.append(f"  not modelled: {j['label']}: {j['reason']}")
    for j in result["cases"]:
        for n in j["notes"]:
            lines.append(f"  note: {j['label']}: {n}")
    for n in result["notes"] + (record.get("size_notes") or []):
        lines.append(f"  note: {n}")
    first = first_text(result)
    if first:
        lines.append(f"first disagreement: {first}")
    pct = "n/a" if fig["percent"] is None else f"{fig['percent']:.1f}%"
    lines.append(f"agreement: {pct} of modelled cases bit-identical ({fig['agree']} agree, "
                 f"{fig['differ']} differ, {fig['not_modelled']} not modelled of "
                 f"{fig['cases']}); elements: {fig['elements']:,} compared, "
                 f"{fig['elements_differ']:,} differ; repeats identical in {fig['repeatable']} "
                 f"of {fig['cases']} cases"
                 + (f"; channel counts match NCCL's in {fig['channels_agree']} of "
                    f"{fig['channels_checked']}" if fig["channels_checked"] else ""))
    lines.append(f"topology file: {_shown(out / TOPOLOGY_FILE)} (parity diff --at FILE, "
                 "parity exec --emulate-nccl FILE)")
    verdict = {0: "MODEL HOLDS", 1: "MODEL DOES NOT HOLD", 3: "NOTHING CHECKED"}[
        verdict_code(fig)]
    lines.append(f"{verdict}: {summary_line(fig, record, topo)}")
    return lines
