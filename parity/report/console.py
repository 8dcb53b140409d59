"""The console rendering of a diff (``parity diff``): rich on a terminal, plain text otherwise.

It renders a :class:`parity.diff.DiffResult` and computes no verdict. Every name that comes from
the artifacts (FQNs, groups, paths) goes through ``Text`` objects, never markup, so a parameter
called ``a[b]`` prints as such. Laid out for 100 columns; wider terminals get wider tables.
"""

from __future__ import annotations

import os
import sys

from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from parity import consequences, policy
from parity.diff import DiffResult
from parity.diff.magnitude import first_sizes, rel_text, size_texts, ulps_text
from parity.text import ranges
from parity.report.reduction import reduction_section
from parity.records import KIND_OPTIMIZER_STATE
from parity.report.stdout import make_rich_console
from parity.report.text import T

PLAIN_WIDTH = 100
MAX_DIVERGENT_ROWS = 20
MAX_STEP_ROWS = 12
MAX_BUCKET_ROWS = 18
MAX_PROBLEMS = 8
_ABBR = {"all_gather": "AG", "reduce_scatter": "RS"}
_FINAL_KINDS = {"param": "parameter", "buffer": "buffer",
                KIND_OPTIMIZER_STATE: "optimizer state tensor"}
_KIND_COLL = {"grad": "reduce_scatter", "param": "all_gather", "buffer": "all_gather"}
_ORDER_TEXT = {
    "identical": ("identical", "green"),
    "order_differs": ("PAYLOAD ORDER DIFFERS", "bold red"),
    "partition_differs": ("BUCKET PARTITION DIFFERS", "bold red"),
    "layout_differs": ("LAYOUT DIFFERS (sizes, padding or dtype)", "bold yellow"),
    "unavailable": ("not compared (no manifests on one side)", "yellow"),
}


def _order_text(r) -> tuple[str, str]:
    """The bucket layouts' verdict words; when nothing was compared because one side's job
    issued no bucketed collective of a kind (a one-rank compiled job has none), it says that
    instead of blaming missing manifests."""
    o = r.order
    if o.verdict == "unavailable" and not o.compared:
        only = [n.split(": only ", 1) for n in o.notes
                if ": only " in n and "recorded buckets" in n]
        if only:
            said = "; ".join(f"{side[0]} recorded {coll} buckets, {'B' if side[0] == 'A' else 'A'} "
                             "none" for coll, side in only)
            ranks = "1 rank, " if getattr(r, "world_size", None) == 1 else ""
            return f"not compared ({ranks}{said}: no bucketed collective on one side)", "yellow"
    if o.verdict == "unavailable" and o.compared:
        from parity.policy import custom_comm

        why = custom_comm({"compared": o.compared, "notes": o.notes})
        if why:
            return f"not compared ({why})", "yellow"
    fb = o.first_bucket if isinstance(o.first_bucket, dict) else {}
    detail = fb.get("detail") if isinstance(fb.get("detail"), str) else ""
    if o.verdict == "layout_differs" and detail.startswith(consequences.OPS_ONLY):
        # the same bytes in the same places: the op or the group's ranks differ, not sizes
        rest = detail[len(consequences.OPS_ONLY):]
        return ("GROUP DIFFERS (other ranks)" if rest.startswith("group")
                else "REDUCE OP DIFFERS"), "bold yellow"
    return _ORDER_TEXT.get(o.verdict, (o.verdict, ""))


def make_console(file=None, width: int | None = None, force_terminal: bool | None = None) -> Console:
    """A console for reports: colours on a terminal, plain text (no ANSI codes) when piped,
    100 columns when not a terminal and COLUMNS is unset."""
    console = make_rich_console(file=file or sys.stdout, force_terminal=force_terminal,
                                width=width, highlight=False, emoji=False, soft_wrap=False)
    if width is None and not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PLAIN_WIDTH
    return console


def _ranks(ranks: list[int], limit: int = 32) -> str:
    """Ranks as ranges, cut to ``limit`` characters for the console."""
    s = ranges(ranks)
    if len(s) <= limit:
        return s
    cut = s[:limit].rsplit(",", 1)[0]
    return f"{cut}, ... ({len(ranks)} ranks)"


def _indent(t: Text, n: int = 2) -> Padding:
    """A hanging-indented paragraph (wrapped lines keep the indent)."""
    return Padding(t, (0, 0, 0, n), expand=False)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} ({ranges(steps)})"


_WORD_STYLE = {"HOLDS": "bold green", "FAILS": "bold red", "INCOMPLETE": "bold yellow"}


def verdict_text(v: policy.Verdict) -> Text:
    """The one verdict line (parity.policy words it), styled; never wrapped mid-line by us."""
    t = T(v.head(), _WORD_STYLE.get(v.word, "bold"))
    body = v.body()
    if body:
        t.append(": " + body)
    return t


def _verdict_lines(r: DiffResult, fail_on: str = "hash") -> list:
    lines = [verdict_text(r.judge(fail_on))]
    n_steps, n_ranks, n_params = len(r.steps_compared), len(r.ranks_compared), r.params_compared
    line = T("Hashes: ")
    if r.verdict == "match":
        what = list(r.kinds_compared) + (["loss"] if r.loss.captured else [])
        line.append("bitwise identical", "green")
        line.append(f" over {n_steps} steps x {n_ranks} ranks x {n_params} parameters "
                    f"({', '.join(what)})")
    elif r.verdict == "hash_mismatch":
        fd = r.first_divergence
        numbers_only = (fd is not None and fd.origin == "optimizer" and not fd.params
                        and not fd.grads and bool(fd.opt_numbers))  # diff/opt_numbers.py
        line.append("identical, OPTIMIZER NUMBERS DIFFER" if numbers_only else "HASH MISMATCH",
                    "bold red")
        if fd is not None and fd.origin == "final":  # every step matched
            line.append(f" in the final state (after step {fd.step}): ")
            n = {k: sum(1 for d in r.divergent if d.kind == k) for k in _FINAL_KINDS}
            line.append(" and ".join(_plural(n[k], w) for k, w in _FINAL_KINDS.items() if n[k])
                        + f" differ on rank(s) {_ranks(fd.ranks)}")
        elif numbers_only:  # every hash matched
            line.append(f" from step {r.first_divergent_step}")
        else:
            line.append(f" from step {r.first_divergent_step}")
        if fd is not None and fd.origin != "final":
            bits = []
            if fd.grads:
                bits.append(_plural(fd.grads, "gradient"))
            if fd.params:
                bits.append(_plural(fd.params, "parameter"))
            if bits:
                line.append(f": {' and '.join(bits)} differ on rank(s) {_ranks(fd.ranks)}")
            elif fd.loss_differs:
                line.append(": the loss differs")
            line.append(f" ({fd.label or fd.origin})")
    else:
        line.append("INCOMPLETE", "bold yellow")
        line.append(" " + (r.incomplete[0] if r.incomplete else "data incomplete"))
    if getattr(r, "warnings", None):
        line.append(f" ({_plural(len(r.warnings), 'capture warning')})", style="yellow")
    lines.append(line)
    if r.verdict != "incomplete" and r.incomplete:
        lines.append(_indent(T(f"and the data is incomplete: {r.incomplete[0]}", "yellow")))
    o = r.order
    text, style = _order_text(r)
    line = T("Bucket layouts: ")
    line.append(text, style=style)
    fb = o.first_bucket
    if fb:
        line.append(f" from {fb['collective']} {policy.bucket_ref(fb)}")
        if fb.get("group"):
            line.append(" (")
            line.append(T(fb["group"]))
            line.append(")")
        if fb.get("position") is not None:
            line.append(f" position {fb['position']}")
        if fb.get("consequence") in consequences.WORDS:
            line.append(f": {consequences.WORDS[fb['consequence']]}")
    if len(o.consequences) > 1 or sum(o.consequences.values()) > 1:
        line.append(f" [{consequences.counts_phrase(o.consequences)}]")
    lines.append(line)
    ro = r.to_dict_reduction()
    if ro:
        said = (consequences.reduction_phrase(ro) or "").removeprefix("reduction order ")
        lines.append(T("Reduction order: ") + T(said))
    return lines


def _summary(r: DiffResult) -> Panel:
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column(overflow="fold")

    def side(s, label):
        t = T(s.path)
        extra = []
        if s.status and s.status != "ok":
            extra.append(f"status {s.status}")
        extra.append(f"manifests: {s.bucket_source or 'none'}")
        t.append(f"  ({', '.join(extra)})", style="dim")
        g.add_row(label, t)

    side(r.a, "A (reference)")
    side(r.b, "B (candidate)")
    ranks = T(f"{r.world_size}")
    if r.world_size is not None and len(r.ranks_compared) != r.world_size:
        ranks.append(f"  compared: {ranges(r.ranks_compared) or 'none'}", style="yellow")
    g.add_row("World size", ranks)
    steps = T(_steps_text(r.steps_compared))
    if 0 in r.steps_compared:
        steps.append("  step 0: initial parameters; step N: after optimizer step N", style="dim")
    g.add_row("Steps compared", steps)
    p = T(f"{r.params_compared}")
    if r.params_only_in_a or r.params_only_in_b:
        p.append(f"  ({len(r.params_only_in_a)} only in A, {len(r.params_only_in_b)} only in B)",
                 style="yellow")
    g.add_row("Parameters", p)
    fd = r.first_divergence
    if fd is None:
        g.add_row("First divergence", T("none", "green"))
    else:
        t = T(f"step {fd.step}", "bold red")
        t.append(f"  {fd.label or fd.origin}: ")  # what was compared and found, not a pass
        t.append(T(fd.explanation))
        g.add_row("First divergence", t)
    loss = r.loss
    if not loss.captured:
        g.add_row("Loss", T("not captured", "dim"))
    elif loss.first_divergent_step is None:
        g.add_row("Loss", T("bitwise equal at every compared step", "green"))
    else:
        g.add_row("Loss", T(f"first differs at step {loss.first_divergent_step}", "red"))
    o = r.order
    t = T(*_order_text(r))
    if o.compared:
        parts = []
        for c in o.compared:
            cnt = {k: v for k, v in o.counts[c].items() if v}
            parts.append(f"{c.replace('_', '-')}: " + ", ".join(
                f"{v} {k.replace('_', ' ')}" for k, v in cnt.items()))
        t.append(f"  ({o.a_source} vs {o.b_source}, rank {o.rank}; {'; '.join(parts)})")
    g.add_row("Bucket layouts", t)
    return Panel(g, title=T("parity diff"), title_align="left", expand=True)


def _bucket_cell(ref: dict | None, coll: str) -> Text:
    if not ref:
        return T("-", "dim")
    return T(f"{_ABBR[coll]}#{ref['index']}@{ref.get('offset')}")


def _title(s: str) -> Text:
    return T(s, "bold")


def _divergent_table(r: DiffResult) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("kind", no_wrap=True)
    t.add_column("parameter", overflow="fold", ratio=1)
    t.add_column("ranks", overflow="fold", max_width=16)
    sizes = first_sizes(r.magnitude) if (r.magnitude or {}).get("recorded") else {}
    if sizes:  # the size of each difference (summaries: docs/diff.md); buckets in one column
        t.add_column("bucket @ offset A / B", no_wrap=True)
        t.add_column("rel >=", justify="right", no_wrap=True)
        t.add_column("ulps", justify="right", no_wrap=True)
    else:
        t.add_column("A bucket @ offset", no_wrap=True)
        t.add_column("B bucket @ offset", no_wrap=True)
    shown = r.divergent[:MAX_DIVERGENT_ROWS]
    for d in shown:
        coll = _KIND_COLL.get(d.kind)  # (optimizer state: in no collective)
        links = d.buckets.get(coll, {}) if coll else {}
        a, b = _bucket_cell(links.get("a"), coll), _bucket_cell(links.get("b"), coll)
        if sizes:
            cells = [a + T(" / ") + b, *map(T, size_texts(sizes.get(
                (d.fqn, d.kind, d.ranks[0] if d.ranks else None))))]
        else:
            cells = [a, b]
        t.add_row(T(d.kind, "red" if d.kind == "grad" else "magenta"), T(d.fqn),
                  T(_ranks(d.ranks, 16)), *cells)
    if len(r.divergent) > len(shown):
        t.add_row("", T(f"... and {len(r.divergent) - len(shown)} more (--json has all)", "dim"),
                  "", "", "", *([""] if sizes else []))
    if sizes:
        t.caption = ("sizes on the first rank listed: a lower bound from per-tensor figures, "
                     "not a proof (docs/diff.md)")
        t.caption_justify = "left"
    return t


def _size_section(r: DiffResult) -> list:
    """How big the differences are and how they grow over the steps, from the figures next to
    each hash (parity/diff/magnitude.py): summaries, not proofs."""
    m = r.magnitude or {}
    if not m:
        return []
    if not m.get("recorded"):
        absent = [x for x in m.get("absent") or [] if isinstance(x, dict)]
        if absent:  # one side had no such tensor (a gradient that was None): no size
            lines = []
            for side in ("a", "b"):
                names = [str(x.get("fqn")) for x in absent if x.get("side") == side]
                if names:
                    what = "gradient" if all(x.get("kind") == "grad" for x in absent
                                             if x.get("side") == side) else "tensor"
                    lines.append(f"{side.upper()} has no {what} (None, hashed as absent) for "
                                 f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''} "
                                 f"where {'B' if side == 'a' else 'A'} has one")
            return [T("Size of the difference: not shown: " + "; ".join(lines), "dim")]
        return [T("Size of the difference: not shown (the runs carry no per-tensor figures: "
                  "recorded before parity kept them, or by another hasher)", "dim")]
    rows = [s for s in m.get("per_step") or [] if isinstance(s, dict)]
    out: list = [_title(f"Size of the difference per step, rank {rows[0]['rank'] if rows else '?'}"
                        " (largest over the parameters)"),
                 _indent(T(m.get("note") or "", "dim"))]
    if not rows:
        return out
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("step", justify="right")
    for kind in ("params", "grads"):
        t.add_column(f"{kind} differ", justify="right", no_wrap=True)
        t.add_column("rel >=", justify="right", no_wrap=True)
        t.add_column("ulps", justify="right", no_wrap=True)
    t.add_column("largest", overflow="fold", ratio=1)
    for i in _window(len(rows), 0, MAX_STEP_ROWS):
        if i is None:
            t.add_row("...", *[""] * 7)
            continue
        s = rows[i]
        cells = [T(s["step"])]
        top = None
        for kind in ("param", "grad"):
            k = s.get(kind)
            if not isinstance(k, dict):
                cells += [T("-", "dim")] * 3
                continue
            cells += [T(f"{k.get('differ')}" + (f" ({k['nonfinite']} NaN/inf)"
                                                if k.get("nonfinite") else "")),
                      T(rel_text(k.get("rel"))), T(ulps_text(k.get("ulps")))]
            if isinstance(k.get("rel"), (int, float)) and (top is None or k["rel"] > top[1]):
                top = (kind, k["rel"], k.get("fqn"))
        cells.append(T(f"{top[2]} ({top[0]})" if top else "", "dim"))
        t.add_row(*cells)
    out.append(t)
    return out


def _window(n: int, focus: int | None, size: int) -> list[int | None]:
    """Row indices to show (None: an ellipsis row)."""
    if n <= size:
        return list(range(n))
    if focus is None:
        head = size // 2
        return list(range(head)) + [None] + list(range(n - (size - head - 1), n))
    start = max(0, min(focus - 3, n - size))
    idx: list[int | None] = list(range(start, min(n, start + size)))
    if start > 0:
        idx = [0, None] + idx[2:] if start > 1 else idx
    if idx[-1] is not None and idx[-1] < n - 1:
        idx = idx[:-2] + [None, n - 1]
    return idx


def _per_step_table(r: DiffResult) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, caption_justify="left")
    for c in ("step", "params", "grads", "ranks"):
        t.add_column(c, justify="right")
    rows = r.per_step
    for i in _window(len(rows), None, MAX_STEP_ROWS):
        if i is None:
            t.add_row("...", "", "", "")
            continue
        c = rows[i]

        def n(x):
            return "?" if x is None else str(x)
        t.add_row(str(c.step), n(c.params), n(c.grads), n(c.ranks) + ("" if c.exact else " *"))
    if any(not c.exact for c in rows):
        t.caption = "* roll-ups only (drill-down budget spent): parameter counts unknown"
    return t


def _loss_text(v) -> str:
    if v is None:
        return "-"
    return f"{v:.9g}" if isinstance(v, float) else str(v)


def _loss_table(r: DiffResult) -> Table:
    loss = r.loss
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("", no_wrap=True)
    rows = loss.steps
    other = any(s.shown(r.ranks_compared, loss.rank)[0] != loss.rank for s in rows)
    t.add_column("step", justify="right", no_wrap=True, min_width=4)
    if other:  # a step whose loss differs on another rank only: that rank is shown
        t.add_column("rank", justify="right")
    # values to 9 significant digits (every float32 told apart; the bitwise column and the
    # relative difference say the rest): the table fits an 80-column CI log without cutting
    t.add_column("A", justify="right", overflow="fold")
    t.add_column("B", justify="right", overflow="fold")
    t.add_column("(B-A)/|A|", justify="right", overflow="fold")
    t.add_column("bitwise", overflow="fold")
    totals = any(s.a_total is not None or s.b_total is not None for s in rows)
    if totals:  # the global loss a trainer such as torchtitan logs: the ranks' shares summed
        t.add_column("A total", justify="right", overflow="fold")
        t.add_column("B total", justify="right", overflow="fold")
    focus = next((i for i, s in enumerate(rows) if s.step == loss.first_divergent_step), None)
    for i in _window(len(rows), focus, MAX_STEP_ROWS):
        if i is None:
            t.add_row("", "...", *([""] if other else []), "", "", "", "",
                      *(["", ""] if totals else []))
            continue
        s = rows[i]
        shown_rank, a, b = s.shown(r.ranks_compared, loss.rank)
        delta = s.delta(r.ranks_compared, loss.rank)
        first = i == focus
        eq = ("equal" if s.equal else ("-" if s.equal is None else
                                        f"DIFFERS ({_plural(s.ranks_differing, 'rank')})"))
        style = "bold red" if first else ("red" if s.equal is False else None)
        extra = ([T(f"{s.a_total:.6g}" if s.a_total is not None else "-"),
                  T(f"{s.b_total:.6g}" if s.b_total is not None else "-")] if totals else [])
        t.add_row(T(">" if first else ""), T(s.step),
                  *([T(shown_rank if shown_rank == loss.rank else f"{shown_rank}*")]
                    if other else []),
                  T(_loss_text(a)), T(_loss_text(b)),
                  T("0" if delta == 0 else f"{delta:.2g}" if delta is not None else "-"),
                  T(eq), *extra, style=style)
    notes = []
    if totals:
        notes.append("total: all ranks' losses summed (the global loss a trainer such as "
                     "torchtitan logs)")
    if other:
        notes.append(f"* rank {loss.rank}'s loss is equal at that step: the first rank whose "
                     "loss differs is shown")
    if notes:
        t.caption = "\n".join(notes)
        t.caption_justify = "left"
    return t


def _entry_cells(e: dict | None, sizes: bool) -> tuple[Text, Text]:
    if e is None:
        return T("-", "dim"), T("")
    off = f"{e.get('offset')}" + (f" +{e.get('size')}" if sizes else "")
    if sizes and e.get("dtype"):
        off += f" {e['dtype']}"
    return T(e.get("fqn")), T(off)


def first_bucket_section(fb: dict | None) -> list:
    """The first differing bucket side by side, from its JSON form (``order.first_bucket``), so
    sweep reports can show it from a cell's stored diff without the run directories."""
    out: list = []
    if fb:
        what = ("payload order differs" if fb["verdict"] in ("order_differs", "partition_differs")
                else "layout differs")
        out.append(T(f"First bucket whose {what}: {fb['collective']} ({fb['verdict']})", "bold"))
        rows = fb.get("rows") or []

        def side(label, idx, group, key):
            n = sum(1 for row in rows if row.get(key))
            t = T(f"{label}: bucket {idx}")
            if group:
                t.append(" (")
                t.append(T(group))
                t.append(")")
            t.append(f", {_plural(n, 'parameter')}")
            return _indent(t)
        out.append(side("A", fb.get("index"), fb.get("group"), "a"))
        out.append(side("B", fb.get("b_index"), fb.get("b_group"), "b"))
        if fb.get("a") or fb.get("b"):
            head = f"position {fb['position']}: "
            for label, e in (("A", fb.get("a")), ("B", fb.get("b"))):
                line = T(head if label == "A" else " " * len(head))
                line.append(f"{label} ")
                if e:
                    line.append(T(e.get("fqn"), "bold"))
                    line.append(f" @ byte {e.get('offset')}")
                else:
                    line.append("(no parameter)", style="dim")
                out.append(_indent(line))
        if fb.get("detail"):
            out.append(_indent(T(fb["detail"], "dim")))
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=True,
                  caption="> first differing position   * differs", caption_justify="left")
        t.add_column("", no_wrap=True, width=1)
        t.add_column("pos", justify="right", no_wrap=True)
        t.add_column("A parameter", overflow="fold", ratio=1)
        sizes = fb["verdict"] == "layout_differs"  # otherwise offsets say enough
        t.add_column("A offset" + (" +size" if sizes else ""), justify="right", no_wrap=True)
        t.add_column("B parameter", overflow="fold", ratio=1)
        t.add_column("B offset" + (" +size" if sizes else ""), justify="right", no_wrap=True)
        rows = fb.get("rows") or []
        pos = fb.get("position")
        focus = pos if isinstance(pos, int) and pos < len(rows) else None
        for i in _window(len(rows), focus, MAX_BUCKET_ROWS):
            if i is None:
                t.add_row("", "...", "", "", "", "")
                continue
            row = rows[i]
            first = i == focus
            af, ao = _entry_cells(row.get("a"), sizes)
            bf, bo = _entry_cells(row.get("b"), sizes)
            style = "bold red" if first else (None if row.get("same") else "yellow")
            mark = ">" if first else ("" if row.get("same") else "*")
            t.add_row(T(mark), T(row["position"]), af, ao, bf, bo, style=style)
        out.append(t)
    return out


def _bucket_section(r: DiffResult) -> list:
    o = r.order
    fb = o.first_bucket
    out = first_bucket_section(fb)
    # the most consequential first: reductions (sums may change), then copies (values unchanged)
    others = [p for _, p in sorted(
        (consequences.lead_key(p.consequence, p.verdict, i), p)
        for i, p in enumerate(o.pairs) if p.verdict != "identical")]
    if len(others) > (1 if fb else 0):
        out.append(T(f"Buckets that differ ({len(others)}):", "bold"))
        for p in others[:MAX_PROBLEMS]:
            line = T(f"[{consequences.TITLE.get(p.consequence or '', '?')}] "
                     f"{_ABBR.get(p.collective, p.collective)} "
                     f"A#{','.join(map(str, p.a)) or '-'} / B#{','.join(map(str, p.b)) or '-'} "
                     f"{p.verdict}: ")
            line.append(T(p.detail))
            if p.verdict == "order_differs" and p.a_entry and p.b_entry:
                line.append(f"; position {p.position}: A ")
                line.append(T(p.a_entry["fqn"]))
                line.append(f" @ {p.a_entry['offset']}, B ")
                line.append(T(p.b_entry["fqn"]))
                line.append(f" @ {p.b_entry['offset']}")
            out.append(_indent(line, 4))
        if len(others) > MAX_PROBLEMS:
            out.append(_indent(T(f"... and {len(others) - MAX_PROBLEMS} more (--json has all)",
                                 "dim"), 4))
    for side, msgs in o.rank_disagreements.items():
        for m in msgs[:MAX_PROBLEMS]:
            out.append(T(f"warning: {side.upper()}'s ranks disagree on bucket layouts: {m}",
                         "yellow"))
    for n in o.notes[:MAX_PROBLEMS]:
        out.append(T(f"note: {n}", "dim"))
    if len(o.notes) > MAX_PROBLEMS:
        out.append(T(f"note: ... and {len(o.notes) - MAX_PROBLEMS} more", "dim"))
    return out


def print_diff(result: DiffResult, console: Console | None = None, fail_on: str = "hash") -> None:
    """Render ``result``: the verdict line under ``fail_on``, summary, divergent parameters, per-step counts, loss, the
    first differing bucket side by side, warnings."""
    c = console or make_console()
    r = result
    lines = _verdict_lines(r, fail_on)
    c.print(lines[0], soft_wrap=True)  # the verdict: one line, never wrapped (grep, CI logs)
    for line in lines[1:]:
        c.print(line)
    c.print(_summary(r))
    if r.divergent:
        c.print(_title(f"Divergent at step {r.divergent[0].step} (grads: reduce-scatter "
                       "bucket, params: all-gather bucket)"))
        c.print(_divergent_table(r))
    if len(r.per_step) > 1:
        c.print(_title("Divergent per step (parameters whose hash differs on any rank)"))
        c.print(_per_step_table(r))
    for part in _size_section(r):
        c.print(part)
    if r.loss.captured and (r.loss.first_divergent_step is not None or r.verdict != "match"):
        c.print(_title(f"Loss of rank {r.loss.rank} (* another rank), side by side"
                       if any(s.shown(r.ranks_compared, r.loss.rank)[0] != r.loss.rank
                              for s in r.loss.steps) else
                       f"Loss of rank {r.loss.rank}, side by side"))
        c.print(_loss_table(r))
    section = _bucket_section(r)
    if section:
        c.print(Group(*section))
    pred = reduction_section(r.to_dict_reduction())  # --at: the prediction
    if pred:
        c.print(Group(*pred))
    if r.bucketing:  # issue 14: what the bucketing passes did, A and B side by side
        from parity.report.bucket_summary import print_summary_pair

        print_summary_pair(r.bucketing.get("a"), r.bucketing.get("b"), c, r.bucketing.get("moved"))
    warnings = [T(f"incomplete: {m}", "yellow") for m in r.incomplete]
    for w in getattr(r, "warnings", [])[:MAX_PROBLEMS]:
        warnings.append(T(f"capture warning: {w.side.upper()} rank(s) {ranges(w.ranks)}: "
                          f"{w.message}", "yellow"))
    probs = r.problems
    for p in probs[:MAX_PROBLEMS]:
        warnings.append(T(f"warning: {(p.side.upper() + ': ') if p.side else ''}{p.message}",
                          "yellow"))
    if len(probs) > MAX_PROBLEMS:
        warnings.append(T(f"warning: ... and {len(probs) - MAX_PROBLEMS} more problems "
                          "(--json has all)", "yellow"))
    for w in warnings:
        c.print(w)
