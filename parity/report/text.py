"""Text from runs (parameter names, axis values, log lines, reasons) made safe to show.

Names come from user models and specs: they may hold ANSI escapes (which would drive the
terminal), bidirectional-override characters (which reorder what a reviewer reads) or lone
surrogates (a non-UTF-8 name read through ``surrogateescape``, which no UTF-8 file can carry).
Every report format shows them as visible escapes (``\\x1b``, ``\\u202e``, ``\\udcff``) instead.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported by T: the CLI imports safe_text's users at start
    from rich.text import Text

# C0 and C1 controls, DEL, bidi marks/embeddings/overrides/isolates, lone surrogates
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
_UNSAFE_KEEP_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                                "\u2066-\u2069\ud800-\udfff]")


def _escape(m: re.Match) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe_text(text, keep_lines: bool = False) -> str:
    """``text`` with every unsafe character written as a visible escape (tab and newline kept
    with ``keep_lines``)."""
    s = "" if text is None else str(text)
    return (_UNSAFE_KEEP_LINES if keep_lines else _UNSAFE).sub(_escape, s)


def T(s, style: str | None = None) -> Text:
    """Literal rich text for the console (never markup; unsafe characters escaped)."""
    from rich.text import Text

    return Text(safe_text(s, keep_lines=True), style=style or "")
