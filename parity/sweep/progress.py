"""Sweep progress on stderr: one line per event (CI logs), or a live table of running jobs on a
terminal. The runner reports events; this module only shows them."""

from __future__ import annotations

import os
import re
import time

_CONTROL = re.compile("[\x00-\x1f\x7f]")


def make_progress(err, steps: int):
    isatty = getattr(err, "isatty", lambda: False)()
    if isatty and os.environ.get("TERM") != "dumb":
        try:
            return _RichProgress(err, steps)
        except Exception:
            pass
    return _PlainProgress(err, steps)


class _PlainProgress:
    """One line per event on stderr (CI logs); step counts at most every 15 s per job."""

    def __init__(self, err, steps: int):
        self.err, self.steps = err, steps
        self.t0 = time.time()
        self.jobs: dict[tuple[str, str], list] = {}  # -> [start, last step, last print]
        self.total = self.done = 0

    def _w(self, line: str) -> None:
        line = _CONTROL.sub(" ", line)
        self.err.write(f"[{time.time() - self.t0:7.1f}s] {line}\n")
        self.err.flush()

    def begin(self, todo: int, total: int) -> None:
        self.total = todo
        self._w(f"sweep: {todo} cell(s) to run of {total}")

    def job_start(self, cid, side) -> None:
        self.jobs[(cid, side)] = [time.time(), 0, time.time()]
        self._w(f"{cid} {side}: started")

    def job_tick(self, cid, side, step) -> None:
        j = self.jobs.get((cid, side))
        if j and step != j[1] and time.time() - j[2] >= 15:
            j[1], j[2] = step, time.time()
            self._w(f"{cid} {side}: step {max(0, step - 1)}/{self.steps} "
                    f"({time.time() - j[0]:.0f}s)")

    def job_end(self, cid, side, status, wall, reason) -> None:
        self.jobs.pop((cid, side), None)
        self._w(f"{cid} {side}: {status} in {wall:.1f}s" + (f" ({reason})" if reason else ""))

    def cell_done(self, cid, status, reason) -> None:
        self.done += 1
        self._w(f"[{self.done}/{self.total}] {cid}: {status}" + (f" - {reason}" if reason else ""))

    def note(self, cid, text) -> None:
        """A cell-level event worth a line (e.g. an early stop)."""
        self._w(f"{cid}: {text}")

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class _RichProgress(_PlainProgress):
    """A live table of running jobs (cell, side, step, elapsed) above the finished-cell lines."""

    def __init__(self, err, steps: int):
        super().__init__(err, steps)
        from rich.console import Console
        from rich.live import Live

        self.console = Console(file=err)
        self.steps_seen: dict[tuple[str, str], int] = {}
        self.live = Live(self._render(), console=self.console, refresh_per_second=4,
                         transient=True)
        self.live.start()

    def _w(self, line: str) -> None:
        from rich.markup import escape

        line = _CONTROL.sub(" ", line)
        self.console.print(escape(f"[{time.time() - self.t0:7.1f}s] {line}"), highlight=False)

    def _render(self):
        from rich.table import Table
        from rich.text import Text

        t = Table(box=None, show_header=True, header_style="bold", pad_edge=False)
        for col in ("cell", "side", "step", "elapsed"):
            t.add_column(col)
        for (cid, side), (start, _, _) in self.jobs.items():
            step = self.steps_seen.get((cid, side), 0)
            t.add_row(Text(cid), Text(side), f"{max(0, step - 1)}/{self.steps}",
                      f"{time.time() - start:.0f}s")
        t.caption = f"{self.done}/{self.total} cells done, {time.time() - self.t0:.0f}s"
        return t

    def job_start(self, cid, side) -> None:
        self.jobs[(cid, side)] = [time.time(), 0, time.time()]
        self._w(f"{cid} {side}: started")

    def job_tick(self, cid, side, step) -> None:
        self.steps_seen[(cid, side)] = step

    def refresh(self) -> None:
        self.live.update(self._render())

    def close(self) -> None:
        self.live.stop()
