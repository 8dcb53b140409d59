"""Run a sweep: expand the spec, run both sides of every cell through a launcher, diff each cell.

This module is the scheduler; progress.py shows what happens, results.py reads what a job left
(a clean finish, the cell's diff), launchers.py picks the launcher.

The runner owns the schedule and the state on disk (parity.sweep.state); the launcher owns
processes; the diff engine and parity.policy own verdicts; the caller (cli.py) renders and gates
the result. Every state change of a cell is written atomically to its cell.json at once, so an
interrupted sweep loses nothing that finished and ``--resume`` reruns only what has no complete
result.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

from parity.errors import ParityError, SpecError
from parity.rundir import count_steps, live_rank_dir, rank_dir
from parity.sweep import state as st
from parity.sweep.launcher import CANCELLED, OK, Job, JobResult, Launcher
from parity.sweep.launchers import make_launcher
from parity.sweep.model import SideResult
from parity.sweep.progress import make_progress
from parity.sweep.results import clean_finish, compare_cell
from parity.sweep.spec import SIDES, Cell, Spec, load_spec, matches, parse_only, safe_component

DEFAULT_ROOT = Path("reports")


def run_sweep(spec: str | os.PathLike | None = None, *, out_dir=None, only: str | None = None,
              jobs: int | None = None, resume: bool = False, steps: int | None = None,
              dry_run: bool = False, launcher: str | None = None, fail_on: str = "hash",
              grace: float = 5.0, poll_interval: float = 0.2, out=None, err=None) -> dict | None:
    """Run a sweep and return its report (sweep.json as loaded; None with ``dry_run``, which only
    prints the plan). The caller renders and gates it (``parity sweep``: cli.py).

    ``spec`` is a spec file (None: the CPU default, or with ``resume`` the spec.toml already in
    ``out_dir``). ``out``/``err`` are the text streams for the dry run's plan and the progress
    (stdout and stderr by default).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if jobs is not None and jobs < 1:
        raise ParityError("--jobs must be at least 1")
    base_dir = None
    if spec is None and resume and out_dir and (Path(out_dir) / st.SPEC_COPY).is_file():
        # the copy of the spec as it ran; its relative paths resolve where the original's did
        spec = Path(out_dir) / st.SPEC_COPY
        recorded = st.read_marker(Path(out_dir)).get("spec_dir")
        base_dir = Path(recorded) if isinstance(recorded, str) else None
    sp = load_spec(spec, base_dir)
    from parity.sweep.spec import default_spec_path

    spec_dir = base_dir or Path(os.path.abspath(spec if spec is not None
                                                else default_spec_path())).parent
    sweep_dir = Path(out_dir) if out_dir else DEFAULT_ROOT / safe_component(sp.name)
    sweep_dir = Path(os.path.abspath(sweep_dir))
    launcher_name = launcher or sp.launcher.type
    only_sel = parse_only(only, sp)
    n_steps = sp.steps if steps is None else steps
    cells = sp.cells(steps=n_steps, sweep_dir=sweep_dir)
    selected = {c.id for c in cells if matches(c, only_sel)}
    if not selected:
        raise SpecError(f"--only {only!r}: matches no cell of {sp.name}")

    if dry_run:
        _dry_run(sp, cells, selected, sweep_dir, launcher_name, n_steps, grace, out)
        return None

    lnch = make_launcher(launcher_name, sp.launcher.options, grace=grace)
    if jobs is None:  # local: one job at a time (2 cores); slurm: all at once, the queue schedules
        jobs = 1 if launcher_name == "local" else max(1, 2 * len(selected))
    st.prepare_sweep_dir(sweep_dir)
    lock = st.SweepLock(sweep_dir).acquire()
    try:
        st.write_marker(sweep_dir, spec_dir)
        run = _Run(sp, lnch, sweep_dir, cells, selected, resume=resume, jobs=jobs,
                   poll_interval=poll_interval, err=err, steps=n_steps)
        sweep = run.execute(only=only, fail_on=fail_on, launcher_name=launcher_name)
    finally:
        lnch.close()
        lock.release()

    return sweep


# ------------------------------------------------------------------------------------ dry run


def _dry_run(sp: Spec, cells: list[Cell], selected: set[str], sweep_dir: Path, launcher_name: str,
             steps: int, grace: float, out) -> int:
    """Print every selected cell, why it would be skipped, and both sides' commands."""
    from parity.sweep.launcher import parity_command

    note, stand_in = "", False
    try:
        lnch = make_launcher(launcher_name, sp.launcher.options, grace=grace)
    except ParityError as e:
        lnch, stand_in = make_launcher("local", grace=grace), True
        note = f"\nnote: {e}; showing local commands, requirements not checked"
    prefix = parity_command()
    w = out.write
    w(f"sweep {sp.name}: {len(selected)} of {len(cells)} cells, {steps} steps, "
      f"{sp.nnodes}x{sp.nproc_per_node} ranks, launcher {launcher_name}{note}\n")
    w(f"output: {sweep_dir}\n")
    for cell in cells:
        if cell.id not in selected:
            continue
        reason = "" if stand_in else _skip_reason(sp, lnch, cell)
        w(f"\n{cell.id}" + (f"  SKIPPED: {reason}" if reason else "") + "\n")
        for side in SIDES:
            job = _make_job(sp, cell, side, sweep_dir)
            argv = lnch.command(job)
            if argv[:len(prefix)] == prefix:
                argv = ["parity", *argv[len(prefix):]]
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in job.env.items())
            w(f"  {side}: {(env + ' ') if env else ''}{shlex.join(argv)}\n")
    lnch.close()
    return 0


# ------------------------------------------------------------------------------------- helpers


def _make_job(sp: Spec, cell: Cell, side: str, sweep_dir: Path, cwd: Path | None = None) -> Job:
    cdir = st.cell_dir(sweep_dir, cell.id)
    sj = cell.sides[side]
    return Job(cell_id=cell.id, side=side, entry_argv=list(sj.entry_argv), nnodes=sp.nnodes,
               nproc_per_node=sp.nproc_per_node, env=dict(sj.env), run_dir=cdir / side,
               log_dir=cdir / "logs" / side, timeout=sp.timeout,
               console_log=cdir / "logs" / f"{side}.console.log", cwd=sp.workdir or cwd,
               capture=sp.capture, emulate_nccl=sp.emulate_nccl)


def _skip_reason(sp: Spec, lnch: Launcher, cell: Cell) -> str:
    why = lnch.unsupported(sp.nnodes, sp.nproc_per_node)
    if why:
        return why
    for req in cell.requires:
        why = lnch.unmet(req, sp.nnodes)
        if why:
            return why
    return ""


# ---------------------------------------------------------------------------------- execution


class _Run:
    def __init__(self, sp: Spec, lnch: Launcher, sweep_dir: Path, cells: list[Cell],
                 selected: set[str], *, resume: bool, jobs: int, poll_interval: float, err,
                 steps: int):
        self.sp, self.lnch, self.dir = sp, lnch, sweep_dir
        self.cells, self.selected = cells, selected
        self.resume, self.jobs, self.poll_interval = resume, jobs, poll_interval
        self.steps = steps
        self.progress = make_progress(err, steps)
        self.states: dict[str, dict] = {}
        self.queue: deque[tuple[Cell, str]] = deque()
        self.running: dict[int, tuple[object, Cell, str, Job]] = {}
        self.started = time.time()
        # jobs of a spec without workdir run where the sweep was first started (recorded in the
        # marker), so a --resume from another directory runs them where the kept sides ran
        recorded = st.read_marker(sweep_dir).get("cwd")
        self.cwd = Path(recorded) if isinstance(recorded, str) else None
        self.jobs_wall = 0.0  # the summed wall time of the jobs this invocation ran
        self.jobs_run = 0

    # ---------------------------------------------------------------------------- planning

    def plan(self) -> None:
        for cell in self.cells:
            fps = {s: cell.sides[s].fingerprint(self.sp, cell) for s in SIDES}
            old = st.read_cell(self.dir, cell.id)
            if cell.id not in self.selected:
                if old and old.get("fingerprint") == fps and old.get("status") in (
                        *st.COMPARED, st.FAILED):
                    self.states[cell.id] = old
                else:
                    s = st.new_cell_state(cell, fps)
                    s.update(status=st.SKIPPED, reason="not selected by --only")
                    self.states[cell.id] = s
                continue
            if self.resume and st.is_complete(old, fps):
                old["resumed"] = True
                self.states[cell.id] = old
                continue
            s = st.new_cell_state(cell, fps)
            reason = _skip_reason(self.sp, self.lnch, cell)
            if reason:
                s.update(status=st.SKIPPED, reason=reason)
                self.states[cell.id] = s
                st.cell_dir(self.dir, cell.id).mkdir(parents=True, exist_ok=True)
                st.write_cell(self.dir, s)
                continue
            for side in SIDES:
                kept = st.reusable_side(old, side, fps[side], self.dir) if self.resume else None
                if kept:
                    s["sides"][side] = {**kept, "reused": True}
                else:
                    self.queue.append((cell, side))
            self.states[cell.id] = s
            if all(side in s["sides"] for side in SIDES):  # both sides reused: diff again
                self.queue.append((cell, "__diff__"))

    # ---------------------------------------------------------------------------- running

    def check_resume(self) -> None:
        """``--resume`` never deletes a finished cell: if the spec asks for other jobs than a
        compared cell ran (its fingerprint changed), refuse before anything is touched."""
        if not self.resume:
            return
        changed = []
        for cell in self.cells:
            old = st.read_cell(self.dir, cell.id)
            if cell.id in self.selected and old and old.get("status") in st.COMPARED:
                fps = {s: cell.sides[s].fingerprint(self.sp, cell) for s in SIDES}
                if old.get("fingerprint") != fps:
                    changed.append(cell.id)
        if changed:
            raise SpecError(f"--resume: {len(changed)} finished cell(s) ran other commands than "
                            f"the spec gives now ({', '.join(changed[:3])}"
                            f"{', ...' if len(changed) > 3 else ''}); refusing to replace them "
                            "(rerun without --resume, or with the original spec)")

    def execute(self, *, only, fail_on, launcher_name) -> dict:
        self.check_resume()
        (self.dir / st.SPEC_COPY).write_text(self.sp.text)
        self.plan()
        self._write_sweep(complete=False, only=only, fail_on=fail_on, launcher=launcher_name)
        todo = {c.id for c, _ in self.queue}
        self.progress.begin(len(todo), len(self.cells))
        interrupted = False
        old_term = _install_sigterm()
        try:
            self._loop()
        except KeyboardInterrupt:
            interrupted = True
            # a second Ctrl-C or SIGTERM must not cut the cleanup short and leave orphans
            saved = ({sig: signal.signal(sig, signal.SIG_IGN)
                      for sig in (signal.SIGINT, signal.SIGTERM)} if _main_thread() else {})
            try:
                self._cancel_all()
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)
        finally:
            _restore_sigterm(old_term)
            self.progress.close()
        sweep = self._write_sweep(complete=not interrupted, only=only, fail_on=fail_on,
                                  launcher=launcher_name, ended=time.time())
        if interrupted:
            err = self.progress.err
            err.write(f"parity: sweep interrupted; finished cells kept in {self.dir} "
                      "(rerun with --resume)\n")
            raise KeyboardInterrupt
        return sweep

    def _loop(self) -> None:
        while self.queue or self.running:
            while self.queue and len(self.running) < self.jobs:
                cell, side = self.queue.popleft()
                if side == "__diff__":
                    self._finish_cell(cell)
                    continue
                s = self.states[cell.id]
                if s["status"] == st.FAILED:  # the other side already failed: do not run this one
                    continue
                self._start(cell, side)
            for key, (handle, cell, side, job) in list(self.running.items()):
                result = self.lnch.poll(handle)
                if result is None:
                    live = live_rank_dir(job.run_dir, 0)
                    self.progress.job_tick(cell.id, side, count_steps(live)
                                           if live else 0)
                    continue
                del self.running[key]
                self._side_done(cell, side, job, result)
            self.progress.refresh()
            if self.running:
                time.sleep(self.poll_interval)

    def _start(self, cell: Cell, side: str) -> None:
        s = self.states[cell.id]
        if s["status"] == st.PENDING:
            keep = tuple(k for k, v in s["sides"].items() if v.get("reused"))
            st.reset_cell(self.dir, cell.id, keep_sides=keep)
            s.update(status=st.RUNNING, started=time.time())
        job = _make_job(self.sp, cell, side, self.dir, self.cwd)
        s["sides"][side] = SideResult(
            status="running", label=cell.sides[side].label, started=time.time(),
            run_dir=st.rel(job.run_dir, self.dir), log_dir=st.rel(job.log_dir, self.dir),
            console_log=st.rel(job.console_log, self.dir)).to_dict()
        st.write_cell(self.dir, s)
        handle = self.lnch.start(job)
        self.running[id(handle)] = (handle, cell, side, job)
        self.progress.job_start(cell.id, side)

    def _side_done(self, cell: Cell, side: str, job: Job, res: JobResult) -> None:
        s = self.states[cell.id]
        self.jobs_wall += res.wall
        self.jobs_run += 1
        status, reason = res.status, res.reason
        if status == "failed" and res.exit_code is not None and self.sp.tolerate_teardown_exit and (
                clean_finish(job.run_dir, self.sp.world_size, self.steps)):
            status, reason = OK, (f"exit code {res.exit_code} after every rank recorded every "
                                  "step (tolerate_teardown_exit)")
        logs = [{k: (st.rel(v, self.dir) if k in ("stdout", "stderr", "error") else v)
                 for k, v in entry.items()} for entry in res.rank_logs]
        s["sides"][side] = SideResult(
            status=status, label=cell.sides[side].label, exit_code=res.exit_code,
            reason=reason, started=res.started, ended=res.ended, wall=round(res.wall, 3),
            command=res.command, run_dir=st.rel(job.run_dir, self.dir),
            log_dir=st.rel(job.log_dir, self.dir), console_log=st.rel(job.console_log, self.dir),
            rank_logs=logs, steps_recorded=count_steps(rank_dir(job.run_dir, 0)),
            leftovers_killed=res.leftovers_killed).to_dict()
        self.progress.job_end(cell.id, side, status, res.wall, reason)
        if status == CANCELLED:  # interrupted: the cell has no result and --resume reruns it
            s.update(status=st.PENDING, reason="interrupted")
            st.write_cell(self.dir, s)
            return
        if status != OK:
            why = f"{side}: {reason or status}"
            if s["status"] == st.FAILED:  # the other side failed first (both ran concurrently)
                s["reason"] = f"{s['reason']}; {why}"
            else:
                s.update(status=st.FAILED, reason=why, ended=time.time())
                self.progress.cell_done(cell.id, st.FAILED, why)
            for other in SIDES:  # a queued other side is not run (the queue checks the status)
                if other not in s["sides"]:
                    s["sides"][other] = SideResult(status="not_run",
                                                   reason=f"not run: {side} failed").to_dict()
            self._diff_partial(cell)
            st.write_cell(self.dir, s)
            return
        st.write_cell(self.dir, s)
        if s["status"] != st.FAILED and all(
                s["sides"].get(x, {}).get("status") == OK for x in SIDES):
            self._finish_cell(cell)

    def _diff_partial(self, cell: Cell) -> None:
        """A failed cell whose other side finished still gets a diff of what the failed side
        wrote (steps up to the last complete one): the cell stays failed, and its reason says
        how far the comparison got and whether it already diverged."""
        s = self.states[cell.id]
        if not all(s["sides"].get(x, {}).get("status") not in (None, "not_run") for x in SIDES):
            return
        cdir = st.cell_dir(self.dir, cell.id)
        _, why, diff = compare_cell(cdir / "reference", cdir / "candidate", cdir / "diff.json",
                                self.dir, tolerate_exit=self.sp.tolerate_teardown_exit,
                                        at=self.sp.at)
        if not diff:
            return
        steps = diff.get("steps_compared") or []
        reached = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        s.update(diff=diff, diff_json=st.rel(cdir / "diff.json", self.dir),
                 reason=f"{s['reason']}; diffed {reached} ({diff.get('verdict')}: {why})")

    def _finish_cell(self, cell: Cell) -> None:
        s = self.states[cell.id]
        cdir = st.cell_dir(self.dir, cell.id)
        s.setdefault("started", time.time())
        status, reason, diff = compare_cell(cdir / "reference", cdir / "candidate", cdir / "diff.json",
                                        self.dir, tolerate_exit=self.sp.tolerate_teardown_exit,
                                        at=self.sp.at)
        s.update(status=status, reason=reason, diff=diff, ended=time.time(),
                 diff_json=st.rel(cdir / "diff.json", self.dir) if diff else None)
        st.write_cell(self.dir, s)
        self.progress.cell_done(cell.id, status, reason)

    def _cancel_all(self) -> None:
        self.lnch.cancel_many([handle for handle, _, _, _ in self.running.values()])
        for key, (handle, cell, side, job) in list(self.running.items()):
            res = self.lnch.poll(handle)
            del self.running[key]
            if res is not None:
                self._side_done(cell, side, job, res)
        for s in self.states.values():
            if s["status"] == st.RUNNING:
                s.update(status=st.PENDING, reason="interrupted")
                st.write_cell(self.dir, s)

    def _write_sweep(self, *, complete: bool, only, fail_on, launcher, ended=None) -> dict:
        states = [self.states[c.id] for c in self.cells if c.id in self.states]
        sweep = st.build_sweep(self.sp, self.dir, states, started=self.started, ended=ended,
                               complete=complete, launcher=launcher, steps=self.steps, only=only,
                               fail_on=fail_on, jobs=self.jobs, jobs_run=self.jobs_run,
                               jobs_wall=self.jobs_wall)
        st.write_sweep(self.dir, sweep)
        sweep["_dir"] = str(self.dir)
        return sweep


# ------------------------------------------------------------------------------------ signals


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _install_sigterm():
    if not _main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def _restore_sigterm(old) -> None:
    if old is not None and _main_thread():
        signal.signal(signal.SIGTERM, old)
