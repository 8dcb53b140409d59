"""The report formats of ``parity report``, by name: a format is one class with one ``render``.

A format subclasses :class:`ReportFormat` and registers under its name::

    @register_format("markdown", title="markdown", help="for a CI job summary")
    class MarkdownFormat(ReportFormat):
        def render(self, report, fail_on):   # the typed SweepReport -> the text written
            return sweep_markdown(report, fail_on)

``title`` is how ``parity report``'s one-line help names it, ``help`` follows the name in
``--format``'s help.

The CLI's ``--format`` choices and help read :data:`FORMATS` (the built-in formats register in
formats.py, which the CLI imports); ``formats.render_sweep`` looks the name up here. A format
that is not text (the HTML page goes to a file by default, the console one to a terminal)
overrides ``write`` instead. docs/architecture.md ("Adding a report format") walks through one.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from parity.errors import ParityError

# name -> the format, in the order registered (the CLI lists them in this order)
FORMATS: dict[str, "ReportFormat"] = {}


class ReportFormat(ABC):
    """One way to render a sweep report. ``render`` is the format; ``write`` sends it to
    ``output`` (a path) or stdout. Renderers present what the sweep recorded, never a verdict
    of their own (statuses come from the runner, the verdict line from parity.policy)."""

    # set by register_format
    name: ClassVar[str] = "?"
    title: ClassVar[str] = "?"  # as prose names it: "JSON", "JUnit"
    help: ClassVar[str] = ""  # one phrase for --format's help

    @abstractmethod
    def render(self, report, fail_on: str) -> str:
        """The whole report as text, under the ``--fail-on`` policy ``fail_on``."""

    def write(self, report, fail_on: str, output=None) -> None:
        """Write ``render``'s text to ``output`` (created with its folder; atomically: the
        whole text, then renamed into place, so a failed write leaves the old file), else
        stdout."""
        from parity.report.stdout import print_safely

        text = self.render(report, fail_on)
        if output:
            write_output(output, text)
        else:
            print_safely(lambda: sys.stdout.write(text))


def register_format(name: str, *, title: str, help: str):
    """Class decorator: register a ReportFormat subclass as format ``name`` (one instance),
    called ``title`` in prose and described by ``help`` in --format's help."""
    def register(cls: type[ReportFormat]) -> type[ReportFormat]:
        if name in FORMATS:
            raise ValueError(f"report format {name!r} registered twice")
        cls.name, cls.title, cls.help = name, title, help
        FORMATS[name] = cls()
        return cls

    return register


def get_format(name: str) -> ReportFormat:
    """The format called ``name``; ParityError (exit 2) naming the known ones otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ParityError(f"unknown format {name!r} (one of {', '.join(FORMATS)})")
    return fmt


def formats_help() -> str:
    """--format's help: 'name: help' for every format, in registration order."""
    return "; ".join(f"{f.name}: {f.help}" for f in FORMATS.values()) + "."


def formats_titles() -> str:
    """'console, JSON, markdown, JUnit or HTML': the formats as a sentence names them."""
    titles = [f.title for f in FORMATS.values()]
    return ", ".join(titles) if len(titles) < 2 else ", ".join(titles[:-1]) + " or " + titles[-1]


def write_output(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (its folder created): a write that fails (a full
    disk, a file-size limit) leaves the old file whole and raises ParityError (exit 2). A symlink
    is followed, a pipe or device written in place (``artifacts.write_bytes_atomic``)."""
    from parity.artifacts import write_text_atomic

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParityError(f"cannot write {path}: {e.strerror or e}") from None
    write_text_atomic(path, text)
