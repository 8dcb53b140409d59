"""Render a sweep report (SWEEP_DIR/sweep.json) as console text, JSON, markdown, JUnit or HTML:
one registered class per format (registry.py has the protocol), each calling its renderer here
(HTML: html.py). The renderers take the typed ``SweepReport``; the public ones also accept
sweep.json as ``load_sweep`` returns it and type it once, at their entry.

Renderers only present what the sweep recorded: statuses and reasons come from the runner and
the diff engine, never from here. Every piece of recorded text is escaped for its format (rich
markup, markdown table syntax and HTML, XML) since axis values and log lines are user data.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from parity import policy
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, ParityError
from parity.text import ranges
from parity.report.registry import (FORMATS, ReportFormat, formats_help,  # noqa: F401
                                    formats_titles, get_format, register_format)
from parity.report.stdout import make_rich_console, print_safely
from parity.report.text import safe_text
from parity.sweep.model import CellResult, SideResult, SweepReport, as_report, got

# parity.diff (numpy), parity.sweep.state, json and ElementTree are imported where used: the CLI
# imports this module for --format's choices, and every command's start stays fast

STATUS_TEXT = {"match": "match", "hash_mismatch": "HASH MISMATCH",
               "order_mismatch": "order mismatch", "failed": "FAILED", "skipped": "skipped",
               "nondeterministic": "NONDETERMINISTIC"}
STATUS_STYLE = {"match": "bold green", "hash_mismatch": "bold red", "order_mismatch": "bold yellow",
                "nondeterministic": "bold cyan",
                "failed": "bold magenta", "skipped": "dim"}
STATUS_ICON = {"match": "✅", "hash_mismatch": "❌", "order_mismatch": "⚠️", "failed": "💥",
               "nondeterministic": "🎲",
               "skipped": "⏭️"}


def render_sweep(sweep, fmt: str = "console", output=None, fail_on: str | None = None) -> None:
    """Render ``sweep`` in format ``fmt`` (a name in :data:`FORMATS`) to ``output`` (a path) or
    stdout, under ``fail_on`` (default: the policy the sweep ran under), as ``parity gate``
    judges it. ``sweep``: the typed report (``state.load_report``, as ``parity report`` loads it
    once), or a sweep directory or its sweep.json, read here."""
    from parity.sweep.gate import sweep_policy
    from parity.sweep.state import load_report

    form = get_format(fmt)
    report = sweep if isinstance(sweep, SweepReport) else load_report(sweep)
    pol = sweep_policy(report, fail_on)
    try:
        form.write(report, pol, output)
    except (AttributeError, TypeError, KeyError, ValueError) as e:  # deeper than load_sweep checks
        raise ParityError(f"{report.dir}/sweep.json: malformed sweep report "
                          f"({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from None


# -------------------------------------------------------------------------------------- formats
# One class per `parity report --format` (registry.py has the protocol), registered in the
# order --format lists them: console here, JSON, markdown and JUnit each after its renderer,
# HTML (html.py renders it) last.


@register_format("console", title="console", help="the matrix and the verdict")
class ConsoleFormat(ReportFormat):
    def render(self, report: SweepReport, fail_on: str) -> str:
        import io

        buf = io.StringIO()
        print_sweep_console(report, buf, color=False, fail_on=fail_on)
        return buf.getvalue()

    def write(self, report: SweepReport, fail_on: str, output=None) -> None:
        if output:  # plain text, no colour
            super().write(report, fail_on, output)
        else:  # a terminal gets colour and its width
            print_safely(lambda: print_sweep_console(report, sys.stdout, fail_on=fail_on))


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _secs(x) -> str:
    if not isinstance(x, (int, float)):
        return ""
    return f"{x:.0f}s" if x >= 10 else f"{x:.1f}s"


def _summary(report: SweepReport) -> str:
    counts = report.counts or {}
    parts = [f"{n} {STATUS_TEXT.get(s, s).lower()}" for s, n in counts.items() if n]
    total = len(report.cells or [])
    tail = "" if report.is_complete() else " (sweep did not finish)"
    return f"{total} cells: " + (", ".join(parts) or "none") + tail


def _cell_time(cell: CellResult):
    walls = [side.wall for side in (cell.sides or {}).values() if isinstance(side, SideResult)
             and isinstance(side.wall, (int, float))]
    return sum(walls) if walls else got(cell.wall)


def _failure_logs(cell: CellResult) -> list[str]:
    """The log files worth opening for a failed cell: the failed side's ranks, console first."""
    out = []
    for side in (cell.sides or {}).values():
        if not isinstance(side, SideResult) or got(side.status) in ("ok", "not_run", "stopped"):
            continue
        m = re.search(r"\brank (\d+):", str(side.reason or ""))
        blamed = int(m.group(1)) if m else None
        ranks = [r for r in side.rank_logs or [] if isinstance(r, dict) and r.get("stderr")]
        ranks.sort(key=lambda r: (r.get("rank") != blamed, r.get("rank", 0)))
        out += [r["stderr"] for r in ranks[:1]]
        if side.console_log:
            out.append(side.console_log)
        out += [r["stderr"] for r in ranks[1:]]
    return out


# the first finding shown
SEVERITY = {"failed": 0, "nondeterministic": 0.5, "hash_mismatch": 1, "order_mismatch": 2}


def first_finding(report: SweepReport) -> CellResult | None:
    """The most severe cell (failed, then hash mismatch, then order mismatch), first in matrix
    order among equals."""
    cells = [cell for cell in report.cells or []
             if isinstance(cell, CellResult) and cell.status in SEVERITY]
    return min(cells, key=lambda cell: SEVERITY[cell.status]) if cells else None


def side_path(report: SweepReport, path) -> str | None:
    """A path recorded in the sweep (relative to the sweep directory) as seen from here: joined
    to the directory the sweep was read from, so a moved or downloaded folder still works."""
    if not path:
        return None
    path = str(path)
    if os.path.isabs(path):
        return path
    return os.path.join(report.dir or ".", path)


def diff_command(report: SweepReport, cell: CellResult) -> str | None:
    """``parity diff REF CAND`` for a compared cell, shell-quoted, to be printed unwrapped."""
    diff = cell.diff or {}
    a = side_path(report, (diff.get("a") or {}).get("path"))
    b = side_path(report, (diff.get("b") or {}).get("path"))
    if not (a and b):
        return None
    return f"parity diff {shlex.quote(a)} {shlex.quote(b)}"


def cell_ranks(cell: CellResult) -> str:
    """The ranks a cell's finding is on: divergent ranks of a hash mismatch, else the rank whose
    bucket layouts were compared."""
    diff = cell.diff if isinstance(cell.diff, dict) else {}
    fd = diff.get("first_divergence") if isinstance(diff.get("first_divergence"), dict) else {}
    if cell.status == "hash_mismatch" and fd.get("ranks"):
        return ranges(fd["ranks"])
    if cell.status == "order_mismatch":
        r = (diff.get("order") or {}).get("rank")
        return "" if r is None else str(r)
    return ""


def cell_text(report: SweepReport, cell: CellResult, fail_on: str, width: int = 110) -> str:
    """A cell as the console shows it (JUnit failure bodies): verdict line, reason, divergent
    parameters, per-step counts, the first differing bucket, the diff command."""
    import io

    from rich.console import Console

    from parity.report.console import first_bucket_section

    buf = io.StringIO()
    con = Console(file=buf, width=width, no_color=True, force_terminal=False, highlight=False,
                  emoji=False, soft_wrap=False)
    diff = cell.diff if isinstance(cell.diff, dict) else None
    say = lambda text: con.print(_safe(text), markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    if diff:
        say(policy.judge_pair(diff, fail_on).line())
    say(f"{got(cell.status)}: {cell.reason or ''}")
    if diff:
        div = [d for d in diff.get("divergent") or [] if isinstance(d, dict)]
        if div:
            step = div[0].get("step")
            say(f"divergent at step {step} (kind, parameter, ranks):")
            for d in div[:12]:
                say(f"  {d.get('kind')}  {d.get('fqn')}  ranks {ranges(d.get('ranks') or [])}")
            if len(div) > 12:
                say(f"  ... and {len(div) - 12} more (diff.json has all)")
        per = [x for x in diff.get("per_step") or [] if isinstance(x, dict)]
        if len(per) > 1:
            say("divergent per step: " + ", ".join(
                f"step {x.get('step')}: {x.get('params')} params, {x.get('grads')} grads"
                for x in per[:8]))
        for part in first_bucket_section((diff.get("order") or {}).get("first_bucket")):
            con.print(part)
    cmd = diff_command(report, cell)
    if cmd:
        say(f"details: {cmd}")
    for p in _failure_logs(cell)[:3]:
        say(f"log: {side_path(report, p)}")
    return buf.getvalue()


# --------------------------------------------------------------------------------------- console


def _safe(text) -> str:
    """No control characters (a log line's ANSI escapes must not drive the terminal)."""
    return safe_text(_CONTROL.sub(" ", str(text)))



def print_sweep_console(sweep: SweepReport | dict, file=None, color: bool | None = None,
                        fail_on: str | None = None) -> None:
    """The matrix: one row per cell, its axis values, status and the reason; the most severe
    finding; and last the gate's verdict line under ``fail_on`` (default: the sweep's).
    ``sweep``: typed, or sweep.json as ``load_sweep`` returns it (typed here, once)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from parity.diff.bucket_summary import cell_headline
    from parity.report.console import verdict_text
    from parity.sweep.gate import sweep_policy
    from parity.sweep.state import axis_names

    report = as_report(sweep)
    file = file or sys.stdout
    isatty = getattr(file, "isatty", lambda: False)()
    width = None if isatty else int(os.environ.get("COLUMNS", "140") or 140)
    console = make_rich_console(file=file, width=width, no_color=(color is False) or None,
                                force_terminal=False if color is False else None,
                                highlight=False, soft_wrap=False)
    title = f"parity sweep {got(report.name, '?')}"
    if report.description:
        title += f" - {report.description}"
    axes = axis_names(report)
    t = Table(title=Text(_safe(title)), title_justify="left", show_lines=False)
    for a in axes:
        t.add_column(Text(_safe(a)))
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    t.add_column("bucketing A vs B", overflow="fold")  # issue 14: collective counts per side
    t.add_column("time", justify="right")
    for cell in report.cells or []:
        status = got(cell.status, "?")
        row = [Text(_safe(_value((cell.axes or {}).get(a)))) for a in axes]
        row.append(Text(STATUS_TEXT.get(status, status), style=STATUS_STYLE.get(status, "")))
        row.append(Text(_safe(cell.reason or "")))
        row.append(Text(_safe(cell_headline(got(cell.diff)))))
        row.append(_secs(_cell_time(cell)))
        t.add_row(*row)
    console.print(t)
    console.print(escape(_safe(_summary(report))), highlight=False)
    for cell in report.cells or []:
        if cell.status == "failed":
            logs = [side_path(report, p) for p in _failure_logs(cell)]
            if logs:
                shown = ", ".join(logs[:3]) + (f" (+{len(logs) - 3} more)" if len(logs) > 3 else "")
                console.print(escape(_safe(f"  {cell.id}: logs: {shown}")), highlight=False)
    _print_first_finding(console, report)
    if report.dir:
        d = shlex.quote(report.dir)
        console.print(_safe(f"report: {os.path.join(d, 'sweep.json')}  (parity report {d} "
                            f"--format html|markdown|junit; parity gate {d})"), markup=False,
                      highlight=False, soft_wrap=True)
    verdict, _ = policy.judge_sweep(report, sweep_policy(report, fail_on))
    console.print(verdict_text(verdict), soft_wrap=True)


def _print_first_finding(console, report: SweepReport) -> None:
    """The most severe cell's finding in full (failed, hash mismatch, order mismatch): the
    reason, the bucket side by side, and how to diff it (one unwrapped, copyable line)."""
    from parity.report.console import first_bucket_section

    cell = first_finding(report)
    if cell is None:
        return
    diff = cell.diff or {}
    console.print()
    console.print(_safe(f"First finding (most severe), cell {cell.id}: {cell.status}"),
                  style="bold", markup=False, highlight=False, soft_wrap=True)
    console.print(_safe(f"  {cell.reason or ''}"), markup=False, highlight=False)
    if cell.status == "failed":
        for p in _failure_logs(cell)[:3]:
            console.print(_safe(f"  log: {side_path(report, p)}"), markup=False, highlight=False,
                          soft_wrap=True)
    for part in first_bucket_section((diff.get("order") or {}).get("first_bucket")):
        console.print(part)
    cmd = diff_command(report, cell)
    if cmd:
        console.print(_safe(f"details: {cmd}"), markup=False, highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------------------ json


def sweep_json(sweep: SweepReport | dict) -> str:
    """The report as JSON: as it was read (its keys in the file's order), else ``to_dict``."""
    import json

    from parity.artifacts import finite_json

    report = as_report(sweep)
    data = report.source if report.source is not None else report.to_dict()
    return json.dumps(finite_json(data), indent=1, allow_nan=False) + "\n"


@register_format("json", title="JSON", help="sweep.json as is")
class JsonFormat(ReportFormat):
    def render(self, report: SweepReport, fail_on: str) -> str:
        return sweep_json(report)


# -------------------------------------------------------------------------------------- markdown

_CONTROL = re.compile("[\x00-\x1f\x7f]")
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!~|>-])")


def md_escape(text) -> str:
    """Text safe inside a GitHub-flavoured markdown table cell (no markup, no HTML, no '|')."""
    s = safe_text(_CONTROL.sub(" ", str(text)))
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", s)


def sweep_markdown(sweep: SweepReport | dict, fail_on: str | None = None) -> str:
    """A report fit for a CI job summary ($GITHUB_STEP_SUMMARY): the gate's verdict line first,
    the matrix with ranks, the most severe finding's diff command, where the HTML page is.
    ``sweep``: typed, or sweep.json as ``load_sweep`` returns it (typed here, once)."""
    from parity.diff.bucket_summary import cell_headline
    from parity.sweep.gate import sweep_policy
    from parity.sweep.state import axis_names

    report = as_report(sweep)
    axes = axis_names(report)
    verdict, _ = policy.judge_sweep(report, sweep_policy(report, fail_on))
    icon = {"HOLDS": "✅", "FAILS": "❌"}.get(verdict.word, "⚠️")
    lines = [f"## parity sweep `{_code(got(report.name, '?'))}`", ""]
    lines += [f"{icon} **{md_escape(verdict.head())}**: {md_escape(verdict.body())}", ""]
    if report.description:
        lines += [md_escape(report.description), ""]
    lines += [md_escape(_summary(report)), ""]
    sides = report.sides or {}
    if sides:
        lines.append(" vs ".join(f"{md_escape(k)}: {md_escape(v.get('label', k))}"
                                 for k, v in sides.items() if isinstance(v, dict)))
        lines.append("")
    header = [*(md_escape(a) for a in axes), "status", "ranks", "detail", "bucketing A vs B", "time"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * len(header)) + "|")
    for cell in report.cells or []:
        status = got(cell.status, "?")
        row = [md_escape(_value((cell.axes or {}).get(a))) for a in axes]
        row.append(f"{STATUS_ICON.get(status, '')} {md_escape(STATUS_TEXT.get(status, status))}")
        row.append(md_escape(cell_ranks(cell)))
        row.append(md_escape(cell.reason or ""))
        head = cell_headline(got(cell.diff))
        row.append(f"`{_code(head)}`" if head else "")
        row.append(md_escape(_secs(_cell_time(cell))))
        lines.append("| " + " | ".join(row) + " |")
    failed = [cell for cell in report.cells or [] if cell.status == "failed"]
    if failed:
        lines += ["", "<details><summary>logs of failed cells</summary>", ""]
        for cell in failed:
            logs = _failure_logs(cell)
            lines.append(f"- {md_escape(cell.id)}: " + (", ".join(f"`{_code(p)}`" for p in logs)
                                                           or "no logs"))
        lines += ["", "</details>"]
    first = first_finding(report)
    cmd = diff_command(report, first) if first else None
    if cmd:
        lines += ["", f"Most severe finding ({md_escape(first.id)}): `{_code(cmd)}`"]
    if report.dir:
        html = os.path.join(report.dir, "report.html")
        lines += ["", f"HTML report: [{md_escape(html)}]({_link(html)})"
                  + ("" if os.path.exists(html) else
                     f" (write it with `parity report {_code(report.dir)} --format html`)")]
    lines.append("")
    return "\n".join(lines)


@register_format("markdown", title="markdown", help="for a CI job summary")
class MarkdownFormat(ReportFormat):
    def render(self, report: SweepReport, fail_on: str) -> str:
        return sweep_markdown(report, fail_on)


def _link(path: str) -> str:
    """A relative link target: no spaces or parentheses left to end it early."""
    from urllib.parse import quote

    return quote(path.replace(os.sep, "/"), safe="/=,.-_")


def _code(text) -> str:
    """Text inside a `code span`: no backticks or newlines can break out of it."""
    return safe_text(_CONTROL.sub(" ", str(text))).replace("`", "'")


# ----------------------------------------------------------------------------------------- junit

_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _x(text) -> str:
    """Text without the characters XML 1.0 cannot carry (ElementTree escapes the rest)."""
    return _XML_BAD.sub("?", safe_text(text, keep_lines=True))


def sweep_junit(sweep: SweepReport | dict, fail_on: str | None = None) -> str:
    """JUnit XML, as ``parity gate`` judges under ``fail_on`` (default: the sweep's policy): one
    testcase per cell; failing the policy -> failure (body: the cell's console text), failed or
    unproven -> error, skipped -> skipped; a tolerated finding passes and says so.
    ``sweep``: typed, or sweep.json as ``load_sweep`` returns it (typed here, once)."""
    import xml.etree.ElementTree as ET

    from parity.sweep.gate import sweep_policy

    report = as_report(sweep)
    pol = sweep_policy(report, fail_on)
    verdict, _ = policy.judge_sweep(report, pol)
    name = f"parity.{got(report.name, 'sweep')}"
    cells = report.cells or []
    counts = {"tests": len(cells), "failures": 0, "errors": 0, "skipped": 0}
    suite = ET.Element("testsuite", name=_x(name))
    total_time = 0.0
    for cell in cells:
        status = got(cell.status)
        t = _cell_time(cell) or 0.0
        total_time += t
        case = ET.SubElement(suite, "testcase", classname=_x(name), name=_x(got(cell.id, "?")),
                             time=f"{t:.3f}")
        reason = _x(cell.reason or "")
        code = policy.cell_code(cell, pol)
        tolerated = ""
        if code == EXIT_MISMATCH:
            counts["failures"] += 1
            el = ET.SubElement(case, "failure", message=_x(f"{status}: {reason}"), type=status)
            el.text = _x(cell_text(report, cell, pol))
        elif code == EXIT_INCOMPLETE:
            counts["errors"] += 1
            nondet = status == policy.NONDETERMINISTIC
            el = ET.SubElement(case, "error", message=_x(
                f"{status}: {reason}" if nondet else f"unproven under --fail-on {pol}: {reason}"),
                type=status if nondet else "unproven")
            el.text = _x(cell_text(report, cell, pol))
        elif code == EXIT_OK and status != "match":
            tolerated = f"tolerated under --fail-on {pol}: {status}: {reason}\n"
        elif status == "failed":
            counts["errors"] += 1
            el = ET.SubElement(case, "error", message=reason or "failed", type="failed")
            el.text = (_x("logs:\n" + "\n".join(_failure_logs(cell))) if _failure_logs(cell)
                       else reason)
        elif status == "skipped":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=reason)
        elif status != "match":  # pending or running (a sweep read while it runs): not passed
            counts["errors"] += 1
            ET.SubElement(case, "error", message=_x(f"{status}: {reason or 'not compared yet'}"),
                          type=_x(status or "unknown"))
        out = [tolerated + cell_text(report, cell, pol)] if tolerated else []
        for side_name, side in (cell.sides or {}).items():
            if isinstance(side, SideResult) and side.run_dir:
                out.append(f"{side_name}: run {side_path(report, side.run_dir)} logs "
                           f"{side_path(report, got(side.log_dir))} console "
                           f"{side_path(report, got(side.console_log))}")
        if out:
            ET.SubElement(case, "system-out").text = _x("\n".join(out))
    props = ET.Element("properties")
    ET.SubElement(props, "property", name="parity.fail_on", value=pol)
    ET.SubElement(props, "property", name="parity.verdict", value=_x(verdict.line()))
    ET.SubElement(props, "property", name="parity.exit_code", value=str(verdict.code))
    suite.insert(0, props)
    ET.SubElement(suite, "system-out").text = _x(verdict.line())
    for k, v in counts.items():
        suite.set(k, str(v))
    suite.set("time", f"{total_time:.3f}")
    root = ET.Element("testsuites", name="parity sweep", time=f"{total_time:.3f}",
                      **{k: str(v) for k, v in counts.items()})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


@register_format("junit", title="JUnit", help="one testcase per cell")
class JUnitFormat(ReportFormat):
    def render(self, report: SweepReport, fail_on: str) -> str:
        return sweep_junit(report, fail_on)


@register_format("html", title="HTML", help="one self-contained page")
class HtmlFormat(ReportFormat):
    """A file by default (SWEEP_DIR/report.html); its path goes to stdout."""

    def render(self, report: SweepReport, fail_on: str) -> str:
        from parity.report.html import render_sweep_html  # lazy: the HTML report is optional

        return render_sweep_html(report, fail_on)

    def write(self, report: SweepReport, fail_on: str, output=None) -> None:
        from parity.report.html import write_sweep_html

        path = output or os.path.join(report.dir, "report.html")
        write_sweep_html(report, path, fail_on=fail_on)
        print_safely(lambda: sys.stdout.write(f"{path}\n"))
