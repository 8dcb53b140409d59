"""Render a sweep report (SWEEP_DIR/sweep.json) as console text, JSON, markdown, JUnit or HTML.

Renderers only present what the sweep recorded: statuses and reasons come from the runner and
the diff engine, never from here. Every piece of recorded text is escaped for its format (rich
markup, markdown table syntax and HTML, XML) since axis values and log lines are user data.
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from parity.errors import ParityError
from parity.report.text import safe_text

FORMATS = ("console", "json", "markdown", "junit", "html")

STATUS_TEXT = {"match": "match", "hash_mismatch": "HASH MISMATCH",
               "order_mismatch": "order mismatch", "failed": "FAILED", "skipped": "skipped"}
STATUS_STYLE = {"match": "bold green", "hash_mismatch": "bold red", "order_mismatch": "bold yellow",
                "failed": "bold magenta", "skipped": "dim"}
STATUS_ICON = {"match": "✅", "hash_mismatch": "❌", "order_mismatch": "⚠️", "failed": "💥",
               "skipped": "⏭️"}


def render_sweep(sweep_dir, fmt: str = "console", output=None) -> None:
    """Render the sweep in ``sweep_dir`` (or its sweep.json) to ``output`` (a path) or stdout."""
    from parity.sweep.state import load_sweep

    if fmt not in FORMATS:
        raise ParityError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    sweep = load_sweep(sweep_dir)  # checks the fields the renderers read, naming a bad one
    try:
        _render(sweep, fmt, output)
    except (AttributeError, TypeError, KeyError, ValueError) as e:  # deeper than load_sweep checks
        raise ParityError(f"{sweep['_dir']}/sweep.json: malformed sweep report "
                          f"({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from None


def _render(sweep: dict, fmt: str, output) -> None:
    if fmt == "html":
        from parity.report.html import write_sweep_html  # lazy: the HTML report is optional

        path = output or os.path.join(sweep["_dir"], "report.html")
        write_sweep_html(dict(_public(sweep), _dir=sweep["_dir"]), path)
        sys.stdout.write(f"{path}\n")
        return
    if fmt == "console":
        if output:
            with _open_out(output) as f:
                print_sweep_console(sweep, f, color=False)
        else:
            print_sweep_console(sweep, sys.stdout)
        return
    text = {"json": sweep_json, "markdown": sweep_markdown, "junit": sweep_junit}[fmt](sweep)
    if output:
        with _open_out(output) as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def _open_out(path):
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ParityError(f"cannot write {path}: {e.strerror or e}") from None


def _public(sweep: dict) -> dict:
    return {k: v for k, v in sweep.items() if not k.startswith("_")}


def _axis_names(sweep: dict) -> list[str]:
    names = [a["name"] for a in sweep.get("axes") or [] if isinstance(a, dict) and "name" in a]
    if not names:
        for c in sweep.get("cells", []):
            for k in (c.get("axes") or {}):
                if k not in names:
                    names.append(k)
    return names


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _secs(x) -> str:
    if not isinstance(x, (int, float)):
        return ""
    return f"{x:.0f}s" if x >= 10 else f"{x:.1f}s"


def _summary(sweep: dict) -> str:
    counts = sweep.get("counts") or {}
    parts = [f"{n} {STATUS_TEXT.get(s, s).lower()}" for s, n in counts.items() if n]
    total = len(sweep.get("cells") or [])
    tail = "" if sweep.get("complete", True) else " (sweep did not finish)"
    return f"{total} cells: " + (", ".join(parts) or "none") + tail


def _cell_time(c: dict):
    sides = c.get("sides") or {}
    walls = [s.get("wall") for s in sides.values() if isinstance(s, dict)
             and isinstance(s.get("wall"), (int, float))]
    return sum(walls) if walls else c.get("wall")


def _failure_logs(c: dict) -> list[str]:
    """The log files worth opening for a failed cell: the failed side's ranks, console first."""
    out = []
    for name, s in (c.get("sides") or {}).items():
        if not isinstance(s, dict) or s.get("status") in ("ok", "not_run"):
            continue
        m = re.search(r"\brank (\d+):", str(s.get("reason") or ""))
        blamed = int(m.group(1)) if m else None
        ranks = [r for r in s.get("rank_logs") or [] if isinstance(r, dict) and r.get("stderr")]
        ranks.sort(key=lambda r: (r.get("rank") != blamed, r.get("rank", 0)))
        out += [r["stderr"] for r in ranks[:1]]
        if s.get("console_log"):
            out.append(s["console_log"])
        out += [r["stderr"] for r in ranks[1:]]
    return out


# --------------------------------------------------------------------------------------- console


def _safe(text) -> str:
    """No control characters (a log line's ANSI escapes must not drive the terminal)."""
    return safe_text(_CONTROL.sub(" ", str(text)))



def print_sweep_console(sweep: dict, file=None, color: bool | None = None) -> None:
    """The matrix: one row per cell, its axis values, status and the reason."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    file = file or sys.stdout
    isatty = getattr(file, "isatty", lambda: False)()
    width = None if isatty else int(os.environ.get("COLUMNS", "140") or 140)
    console = Console(file=file, width=width, no_color=(color is False) or None,
                      force_terminal=False if color is False else None, highlight=False,
                      soft_wrap=False)
    title = f"parity sweep {sweep.get('name', '?')}"
    if sweep.get("description"):
        title += f" - {sweep['description']}"
    axes = _axis_names(sweep)
    t = Table(title=Text(_safe(title)), title_justify="left", show_lines=False)
    for a in axes:
        t.add_column(Text(_safe(a)))
    t.add_column("status")
    t.add_column("detail", overflow="fold")
    t.add_column("time", justify="right")
    for c in sweep.get("cells") or []:
        status = c.get("status", "?")
        row = [Text(_safe(_value((c.get("axes") or {}).get(a)))) for a in axes]
        row.append(Text(STATUS_TEXT.get(status, status), style=STATUS_STYLE.get(status, "")))
        row.append(Text(_safe(c.get("reason") or "")))
        row.append(_secs(_cell_time(c)))
        t.add_row(*row)
    console.print(t)
    console.print(escape(_safe(_summary(sweep))), highlight=False)
    for c in sweep.get("cells") or []:
        if c.get("status") == "failed":
            logs = _failure_logs(c)
            if logs:
                shown = ", ".join(logs[:3]) + (f" (+{len(logs) - 3} more)" if len(logs) > 3 else "")
                console.print(escape(_safe(f"  {c['id']}: logs: {shown}")), highlight=False)
    _print_first_finding(console, sweep)
    if sweep.get("_dir"):
        d = sweep["_dir"]
        console.print(escape(f"report: {os.path.join(d, 'sweep.json')}  (parity report {d} "
                             "--format html|markdown|junit; parity gate " + d + ")"),
                      highlight=False)


def _print_first_finding(console, sweep: dict) -> None:
    """The first mismatching cell's finding in full: the bucket side by side, and how to diff it."""
    from rich.markup import escape

    from parity.report.console import first_bucket_section

    for c in sweep.get("cells") or []:
        if c.get("status") not in ("hash_mismatch", "order_mismatch"):
            continue
        diff = c.get("diff") or {}
        console.print()
        console.print(escape(_safe(f"First finding, cell {c['id']}:")), style="bold",
                      highlight=False)
        for part in first_bucket_section((diff.get("order") or {}).get("first_bucket")):
            console.print(part)
        a, b = (diff.get("a") or {}).get("path"), (diff.get("b") or {}).get("path")
        if a and b:
            console.print(escape(_safe(f"details: parity diff {a} {b}")), highlight=False)
        return


# ------------------------------------------------------------------------------------------ json


def sweep_json(sweep: dict) -> str:
    from parity.artifacts import finite_json

    return json.dumps(finite_json(_public(sweep)), indent=1, allow_nan=False) + "\n"


# -------------------------------------------------------------------------------------- markdown

_CONTROL = re.compile("[\x00-\x1f\x7f]")
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+!~|>-])")


def md_escape(text) -> str:
    """Text safe inside a GitHub-flavoured markdown table cell (no markup, no HTML, no '|')."""
    s = safe_text(_CONTROL.sub(" ", str(text)))
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", s)


def sweep_markdown(sweep: dict) -> str:
    """A report fit for a CI job summary ($GITHUB_STEP_SUMMARY)."""
    axes = _axis_names(sweep)
    lines = [f"## parity sweep `{_code(sweep.get('name', '?'))}`", ""]
    if sweep.get("description"):
        lines += [md_escape(sweep["description"]), ""]
    lines += [f"**{md_escape(_summary(sweep))}**", ""]
    sides = sweep.get("sides") or {}
    if sides:
        lines.append(" vs ".join(f"{md_escape(k)}: {md_escape(v.get('label', k))}"
                                 for k, v in sides.items() if isinstance(v, dict)))
        lines.append("")
    header = [*(md_escape(a) for a in axes), "status", "detail", "time"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * len(header)) + "|")
    for c in sweep.get("cells") or []:
        status = c.get("status", "?")
        row = [md_escape(_value((c.get("axes") or {}).get(a))) for a in axes]
        row.append(f"{STATUS_ICON.get(status, '')} {md_escape(STATUS_TEXT.get(status, status))}")
        row.append(md_escape(c.get("reason") or ""))
        row.append(md_escape(_secs(_cell_time(c))))
        lines.append("| " + " | ".join(row) + " |")
    failed = [c for c in sweep.get("cells") or [] if c.get("status") == "failed"]
    if failed:
        lines += ["", "<details><summary>logs of failed cells</summary>", ""]
        for c in failed:
            logs = _failure_logs(c)
            lines.append(f"- {md_escape(c['id'])}: " + (", ".join(f"`{_code(p)}`" for p in logs)
                                                        or "no logs"))
        lines += ["", "</details>"]
    lines.append("")
    return "\n".join(lines)


def _code(text) -> str:
    """Text inside a `code span`: no backticks or newlines can break out of it."""
    return safe_text(_CONTROL.sub(" ", str(text))).replace("`", "'")


# ----------------------------------------------------------------------------------------- junit

_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _x(text) -> str:
    """Text without the characters XML 1.0 cannot carry (ElementTree escapes the rest)."""
    return _XML_BAD.sub("?", safe_text(text, keep_lines=True))


def sweep_junit(sweep: dict) -> str:
    """JUnit XML: one testcase per cell; mismatch -> failure, failed -> error, skipped -> skipped."""
    name = f"parity.{sweep.get('name', 'sweep')}"
    cells = sweep.get("cells") or []
    counts = {"tests": len(cells), "failures": 0, "errors": 0, "skipped": 0}
    suite = ET.Element("testsuite", name=_x(name))
    total_time = 0.0
    for c in cells:
        status = c.get("status")
        t = _cell_time(c) or 0.0
        total_time += t
        case = ET.SubElement(suite, "testcase", classname=_x(name), name=_x(c.get("id", "?")),
                             time=f"{t:.3f}")
        reason = _x(c.get("reason") or "")
        if status in ("hash_mismatch", "order_mismatch"):
            counts["failures"] += 1
            el = ET.SubElement(case, "failure", message=_x(f"{status}: {reason}"), type=status)
            el.text = _x(json.dumps(c.get("diff"), indent=1)[:20000]) if c.get("diff") else reason
        elif status == "failed":
            counts["errors"] += 1
            el = ET.SubElement(case, "error", message=reason or "failed", type="failed")
            el.text = _x("logs:\n" + "\n".join(_failure_logs(c))) if _failure_logs(c) else reason
        elif status == "skipped":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=reason)
        out = []
        for side, s in (c.get("sides") or {}).items():
            if isinstance(s, dict) and s.get("run_dir"):
                out.append(f"{side}: run {s.get('run_dir')} logs {s.get('log_dir')} "
                           f"console {s.get('console_log')}")
        if out:
            ET.SubElement(case, "system-out").text = _x("\n".join(out))
    for k, v in counts.items():
        suite.set(k, str(v))
    suite.set("time", f"{total_time:.3f}")
    root = ET.Element("testsuites", name="parity sweep", time=f"{total_time:.3f}",
                      **{k: str(v) for k, v in counts.items()})
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
