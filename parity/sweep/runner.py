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

import dataclasses
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

from parity.errors import ParityError, SpecError
from parity.rundir import count_steps, live_rank_dir, rank_dir
from parity.sweep import control as ctl
from parity.sweep import state as st
from parity.sweep.early_stop import DivergenceWatch
from parity.sweep.launcher import CANCELLED, OK, Job, JobResult, Launcher
from parity.sweep.launchers import LOCAL, make_launcher
from parity.sweep.model import SideResult
from parity.sweep.progress import make_progress
from parity.sweep.results import clean_finish, compare_cell
from parity.sweep import torchtitan_args as torchtitan_check
from parity.sweep.spec import (SIDES, Cell, Spec, check_workdir, load_spec, matches, parse_only,
                               safe_component)

DEFAULT_ROOT = Path("reports")
STOPPED = "stopped"  # a side ended by stop_after_divergence (its recorded steps count)


def run_sweep(spec: str | os.PathLike | None = None, *, out_dir=None, only: str | None = None,
              jobs: int | None = None, resume: bool = False, steps: int | None = None,
              dry_run: bool = False, launcher: str | None = None, fail_on: str = "hash",
              grace: float = 5.0, poll_interval: float = 0.2, out=None, err=None,
              control: bool | None = None) -> dict | None:
    """Run a sweep and return its report (sweep.json as loaded; None with ``dry_run``, which only
    prints the plan). The caller renders and gates it (``parity sweep``: cli.py).

    ``spec`` is a spec file (None: the CPU default, or with ``resume`` the spec.toml already in
    ``out_dir``). ``out``/``err`` are the text streams for the dry run's plan and the progress
    (stdout and stderr by default). ``control`` (``--control``) turns the determinism control on
    over the spec's ``control`` key.
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
    if control:
        sp.control = True
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

    check_workdir(sp)  # before anything is created or launched (exit 2)
    lnch = make_launcher(launcher_name, sp.launcher.options, grace=grace)
    if jobs is None:  # local: one job at a time (2 cores); slurm: all at once, the queue schedules
        jobs = 1 if launcher_name == LOCAL else max(1, 2 * len(selected))
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
        lnch, stand_in = make_launcher(LOCAL, grace=grace), True
        note = f"\nnote: {e}; showing local commands, requirements not checked"
    prefix = parity_command()
    owners: dict[str, str] = {}  # reference fingerprint -> the first cell that runs that job
    w = out.write
    w(f"sweep {sp.name}: {len(selected)} of {len(cells)} cells, {steps} steps, "
      f"{sp.nnodes}x{sp.nproc_per_node} ranks, launcher {launcher_name}{note}\n")
    w(f"output: {sweep_dir}\n")
    tt = torchtitan_check.dry_run_checker(sp, cells, selected, w)
    for cell in cells:
        if cell.id not in selected:
            continue
        reason = "" if stand_in else _skip_reason(sp, lnch, cell)
        w(f"\n{cell.id}" + (f"  SKIPPED: {reason}" if reason else "") + "\n")
        fp = cell.sides["reference"].fingerprint(sp, cell)
        for side in SIDES:
            if side == "reference" and fp in owners:
                w(f"  reference: shared with {owners[fp]} (the same job)\n")
                continue
            if side == "reference" and not reason:
                owners[fp] = cell.id
                if sp.control:
                    w(f"  control: the reference job again, into {ctl.CONTROLS_DIR}/{fp}/run\n")
            job = _make_job(sp, cell, side, sweep_dir)
            argv = lnch.command(job)
            if argv[:len(prefix)] == prefix:
                argv = ["parity", *argv[len(prefix):]]
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in job.env.items())
            w(f"  {side}: {(env + ' ') if env else ''}{shlex.join(argv)}\n")
            if tt is not None and (problem := tt.check(job.entry_argv)):
                w(f"    torchtitan rejects it: {problem}\n")
    lnch.close()
    if tt is not None:
        w(f"\n{tt.summary()}\n")
        if tt.failed:
            raise SpecError(f"{tt.failed} command(s) rejected by torchtitan's parser (above)")
    return 0


# ------------------------------------------------------------------------------------- helpers


def _make_job(sp: Spec, cell: Cell, side: str, sweep_dir: Path, cwd: Path | None = None) -> Job:
    cdir = st.cell_dir(sweep_dir, cell.id)
    sj = cell.sides[side]
    return Job(cell_id=cell.id, side=side, entry_argv=list(sj.entry_argv), nnodes=sp.nnodes,
               nproc_per_node=cell.nproc_per_node, env=dict(sj.env), run_dir=cdir / side,
               log_dir=cdir / "logs" / side, timeout=sp.timeout,
               console_log=cdir / "logs" / f"{side}.console.log", cwd=sp.workdir or cwd,
               capture=sp.capture, emulate_nccl=cell.emulate_nccl)


def _skip_reason(sp: Spec, lnch: Launcher, cell: Cell) -> str:
    why = lnch.unsupported(sp.nnodes, cell.nproc_per_node)
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
        # issue 23: shared reference jobs, the determinism control, early stop
        self.fps: dict[str, dict] = {}
        self.ref_owner: dict[str, str] = {}  # reference fingerprint -> cell running that job
        self.sharers: dict[str, list[str]] = {}  # that cell -> the cells waiting on its job
        self.by_id = {c.id: c for c in cells}
        self.controls: dict[str, dict] = {}  # reference fingerprint -> {cells, side}
        self.watches: dict[str, DivergenceWatch] = {}
        self.early: dict[str, tuple[int, int]] = {}  # cell -> (first divergent step, stop step)
        self.stopping: set[int] = set()  # running keys stopped by stop_after_divergence
        self.finished: set[str] = set()
        self._last_watch = 0.0
        self._control_cache: dict[str, dict] = {}  # reference run -> its control's summary

    # ---------------------------------------------------------------------------- planning

    def plan(self) -> None:
        # references that finished in an earlier invocation (kept by --resume), by job
        # fingerprint: a selected cell with the same reference job reuses them
        done_refs: dict[str, tuple[str, dict]] = {}
        if self.resume:
            for cell in self.cells:
                if cell.id in self.selected:
                    fp = cell.sides["reference"].fingerprint(self.sp, cell)
                    kept = st.reusable_side(st.read_cell(self.dir, cell.id), "reference", fp,
                                            self.dir)
                    if kept:
                        done_refs.setdefault(fp, (cell.id, kept))
        for cell in self.cells:
            fps = {s: cell.sides[s].fingerprint(self.sp, cell) for s in SIDES}
            self.fps[cell.id] = fps
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
            if self.resume and st.is_complete(old, fps) and (
                    not self.sp.control or old.get("control")):
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
                if side == "reference" and not kept and fps[side] in done_refs:
                    src, kept = done_refs[fps[side]]
                    kept = {**kept, "shared_from": kept.get("shared_from") or src}
                if kept:
                    s["sides"][side] = {**kept, "reused": True}
                elif side == "reference" and fps[side] in self.ref_owner:
                    # the same job runs for an earlier cell: share it (issue 23)
                    self.sharers.setdefault(self.ref_owner[fps[side]], []).append(cell.id)
                else:
                    if side == "reference":
                        self.ref_owner[fps[side]] = cell.id
                    self.queue.append((cell, side))
            self.states[cell.id] = s
            if self.sp.control:
                self._plan_control(cell, fps["reference"])
            if all(side in s["sides"] for side in SIDES):  # both sides reused: diff again
                self.queue.append((cell, "__diff__"))
        self._drop_stale_shares()
        self._relink_shares()

    def _plan_control(self, cell: Cell, fp: str) -> None:
        """One control (a repeat of the reference job) per distinct reference job."""
        if fp in self.controls:
            self.controls[fp]["cells"].append(cell.id)
            return
        old = ctl.read_state(self.dir, fp) if self.resume else None
        side = (old or {}).get("side")
        ok = (isinstance(side, dict) and side.get("status") == OK
              and (ctl.control_dir(self.dir, fp) / "run").is_dir())
        self.controls[fp] = {"cells": [cell.id], "side": {**side, "reused": True} if ok else None}
        if not ok:
            self.queue.append((cell, ctl.CONTROL))

    def _relink_shares(self) -> None:
        """The owner of a shared reference job lists the cells that use it
        (``shares_reference_with``) however each got here: a state kept by ``--resume``, an
        owner whose cell reruns (its new state starts empty) while its reference job is kept,
        sharers kept or rerun. Rebuilt from every sharer's ``shared_from``, in cell order; the
        sharers of a job that runs now are added when it ends (_share_reference)."""
        users: dict[str, list[str]] = {}
        for cell in self.cells:
            s = self.states.get(cell.id) or {}
            src = ((s.get("sides") or {}).get("reference") or {}).get("shared_from")
            if src and src != cell.id and src in self.states:
                users.setdefault(src, []).append(cell.id)
        for cid, s in self.states.items():
            if cid in users:
                s["shares_reference_with"] = users[cid]
            else:  # a link kept from before whose sharer no longer uses this job
                s.pop("shares_reference_with", None)

    def _drop_stale_shares(self) -> None:
        """A cell outside --only whose kept result used a reference job in the folder of a cell
        that reruns now (its folder is emptied) no longer has the run its diff read: it is
        listed as not selected, and its files stay where they are."""
        own = {cid for cid, s in self.states.items()
               if (s.get("sides") or {}).get("reference", {}).get("reused")
               and not s["sides"]["reference"].get("shared_from")}
        rerun = {c.id for c, side in self.queue if side in SIDES and c.id not in own}
        for cid, s in self.states.items():
            ref = (s.get("sides") or {}).get("reference") or {}
            src = ref.get("shared_from")
            if cid not in self.selected and src in rerun and src != cid and s.get(
                    "status") != st.SKIPPED:
                keep = st.new_cell_state(self.by_id[cid], self.fps[cid])
                keep.update(status=st.SKIPPED, reason=f"not selected by --only (its reference "
                            f"job, shared from {src}, runs again)")
                self.states[cid] = keep

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
                    self._maybe_finish(cell)
                    continue
                s = self.states[cell.id]
                if s["status"] == st.FAILED and not self._still_needed(cell, side):
                    continue  # the other side already failed: do not run this one
                self._start(cell, side)
            for key, (handle, cell, side, job) in list(self.running.items()):
                result = self.lnch.poll(handle)
                if result is None:
                    live = live_rank_dir(job.run_dir, 0)
                    self.progress.job_tick(cell.id, side, count_steps(live)
                                           if live else 0)
                    continue
                del self.running[key]
                if key in self.stopping and result.status == CANCELLED:
                    result = dataclasses.replace(result, status=STOPPED,
                                                 reason=self._stop_reason(cell, side))
                if side == ctl.CONTROL:
                    self._control_done(cell, job, result)
                else:
                    self._side_done(cell, side, job, result)
            if self.sp.stop_after_divergence is not None and self.running:
                self._watch()
            self.progress.refresh()
            if self.running:
                time.sleep(self.poll_interval)

    def _start(self, cell: Cell, side: str) -> None:
        s = self.states[cell.id]
        if side == ctl.CONTROL:
            self._start_control(cell)
            return
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
                clean_finish(job.run_dir, cell.world_size, self.steps)):
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
        if side == "reference":
            self._share_reference(cell)
        if status not in (OK, STOPPED):
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
        self._maybe_finish(cell)

    def _diff_partial(self, cell: Cell) -> None:
        """A failed cell whose other side finished still gets a diff of what the failed side
        wrote (steps up to the last complete one): the cell stays failed, and its reason says
        how far the comparison got and whether it already diverged."""
        s = self.states[cell.id]
        if not all(s["sides"].get(x, {}).get("status") not in (None, "not_run") for x in SIDES):
            return
        cdir = st.cell_dir(self.dir, cell.id)
        _, why, diff = compare_cell(self._run_dir(cell, "reference"), cdir / "candidate",
                                    cdir / "diff.json", self.dir,
                                    tolerate_exit=self.sp.tolerate_teardown_exit, at=cell.at,
                                    captured=self.sp.capture)
        if not diff:
            return
        steps = diff.get("steps_compared") or []
        reached = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        s.update(diff=diff, diff_json=st.rel(cdir / "diff.json", self.dir),
                 reason=f"{s['reason']}; diffed {reached} ({diff.get('verdict')}: {why})")

    def _finish_cell(self, cell: Cell) -> None:
        s = self.states[cell.id]
        self.finished.add(cell.id)
        cdir = st.cell_dir(self.dir, cell.id)
        s.setdefault("started", time.time())
        stopped = [x for x in SIDES if s["sides"].get(x, {}).get("status") == STOPPED]
        status, reason, diff = compare_cell(
            self._run_dir(cell, "reference"), cdir / "candidate", cdir / "diff.json", self.dir,
            tolerate_exit=self.sp.tolerate_teardown_exit or bool(stopped), at=cell.at,
            captured=self.sp.capture)
        if cell.id in self.early and stopped:
            first, last = self.early[cell.id]
            s["early_stop"] = {"k": self.sp.stop_after_divergence, "first_divergent_step": first,
                               "stopped_after_step": last, "stopped": stopped}
            reason += (f"; stopped early after step {last} (stop_after_divergence = "
                       f"{self.sp.stop_after_divergence}): {', '.join(stopped)}")
        if self.sp.control:
            fp = self.fps[cell.id]["reference"]
            status, reason, s["control"] = ctl.apply(status, reason, diff,
                                                     self._control_summary(cell, fp))
        reason += self._share_note(cell)
        s.update(status=status, reason=reason, diff=diff, ended=time.time(),
                 diff_json=st.rel(cdir / "diff.json", self.dir) if diff else None)
        st.write_cell(self.dir, s)
        self.progress.cell_done(cell.id, status, reason)

    # ------------------------------------------------------- issue 23: sharing, control, stop

    def _run_dir(self, cell: Cell, side: str) -> Path:
        rd = self.states[cell.id]["sides"].get(side, {}).get("run_dir")
        return self.dir / rd if rd else st.cell_dir(self.dir, cell.id) / side

    def _maybe_finish(self, cell: Cell) -> None:
        """Diff the cell once both sides (and its reference's control) are done."""
        s = self.states[cell.id]
        if cell.id in self.finished or s["status"] == st.FAILED:
            return
        if not all(s["sides"].get(x, {}).get("status") in (OK, STOPPED) for x in SIDES):
            return
        if self.sp.control and self.controls.get(self.fps[cell.id]["reference"], {}).get(
                "side") is None:
            return
        self._finish_cell(cell)

    def _share_reference(self, owner: Cell) -> None:
        """The reference job of ``owner`` ended: every cell sharing it gets its result."""
        sharers = self.sharers.get(owner.id, [])
        if not sharers:
            return
        mine = self.states[owner.id]
        mine["shares_reference_with"] = list(dict.fromkeys(
            [*(mine.get("shares_reference_with") or []), *sharers]))
        res = mine["sides"]["reference"]
        for cid in sharers:
            s = self.states[cid]
            s["sides"]["reference"] = {**res, "shared_from": owner.id}
            st.cell_dir(self.dir, cid).mkdir(parents=True, exist_ok=True)
            if res.get("status") not in (OK, STOPPED):
                why = f"reference (shared with {owner.id}): {res.get('reason') or res.get('status')}"
                if s["status"] != st.FAILED:
                    s.update(status=st.FAILED, reason=why, ended=time.time())
                    s["sides"].setdefault("candidate", SideResult(
                        status="not_run", reason="not run: reference failed").to_dict())
                    self.progress.cell_done(cid, st.FAILED, why)
                st.write_cell(self.dir, s)
                continue
            st.write_cell(self.dir, s)
            self._maybe_finish(self.by_id[cid])

    def _still_needed(self, cell: Cell, side: str) -> bool:
        """A failed cell's reference job (or control) still runs for the cells sharing it."""
        if side == "reference":
            return any(self.states[c]["status"] != st.FAILED for c in self.sharers.get(cell.id, []))
        if side == ctl.CONTROL:
            cells = self.controls[self.fps[cell.id]["reference"]]["cells"]
            return any(self.states[c]["status"] != st.FAILED for c in cells)
        return False

    def _share_note(self, cell: Cell) -> str:
        s = self.states[cell.id]
        src = s["sides"].get("reference", {}).get("shared_from")
        if src and src != cell.id:
            return f"; reference job shared with {src}"
        users = s.get("shares_reference_with") or []
        if users:
            return (f"; reference job shared with {', '.join(users[:3])}"
                    + (f" +{len(users) - 3} more" if len(users) > 3 else ""))
        return ""

    def _start_control(self, cell: Cell) -> None:
        fp = self.fps[cell.id]["reference"]
        job = ctl.control_job(_make_job(self.sp, cell, "reference", self.dir, self.cwd),
                              self.dir, fp)
        d = ctl.control_dir(self.dir, fp)
        shutil.rmtree(d, ignore_errors=True)
        job.log_dir.mkdir(parents=True, exist_ok=True)
        ctl.write_state(self.dir, fp, SideResult(status="running", label="control",
                                                 started=time.time()).to_dict())
        handle = self.lnch.start(job)
        self.running[id(handle)] = (handle, cell, ctl.CONTROL, job)
        self.progress.job_start(cell.id, ctl.CONTROL)

    def _control_done(self, cell: Cell, job: Job, res: JobResult) -> None:
        fp = self.fps[cell.id]["reference"]
        self.jobs_wall += res.wall
        self.jobs_run += 1
        self.progress.job_end(cell.id, ctl.CONTROL, res.status, res.wall, res.reason)
        side = SideResult(
            status=res.status, label="control (repeat of the reference)",
            exit_code=res.exit_code, reason=res.reason, started=res.started, ended=res.ended,
            wall=round(res.wall, 3), command=res.command, run_dir=st.rel(job.run_dir, self.dir),
            log_dir=st.rel(job.log_dir, self.dir), console_log=st.rel(job.console_log, self.dir),
            steps_recorded=count_steps(rank_dir(job.run_dir, 0))).to_dict()
        ctl.write_state(self.dir, fp, side)
        if res.status == CANCELLED:  # interrupted: --resume runs it again
            return
        self.controls[fp]["side"] = side
        for cid in self.controls[fp]["cells"]:
            self._maybe_finish(self.by_id[cid])

    def _control_summary(self, cell: Cell, fp: str) -> dict:
        side = self.controls[fp]["side"] or {}
        rec = {"run_dir": side.get("run_dir"), "console_log": side.get("console_log")}
        if side.get("status") != OK:
            return {**ctl.summarize(None, f"{side.get('reason') or side.get('status')}"), **rec}
        run = ctl.control_dir(self.dir, fp) / "run"
        out = ctl.control_dir(self.dir, fp) / f"diff-{cell.id}.json"
        ref = self._run_dir(cell, "reference")
        cached = self._control_cache.get(str(ref))
        if cached is not None:
            return cached
        _, why, diff = compare_cell(ref, run, out, self.dir, tolerate_exit=True,
                                    captured=self.sp.capture)
        rec["diff_json"] = st.rel(out, self.dir) if diff else None
        self._control_cache[str(ref)] = result = {**ctl.summarize(diff, why), **rec}
        return result

    def _stop_reason(self, cell: Cell, side: str) -> str:
        first, last = self.early.get(cell.id, (None, None))
        return (f"stopped after step {last}: {self.sp.stop_after_divergence} step(s) past the "
                f"first divergent step {first} (stop_after_divergence)")

    def _watch(self) -> None:
        """Early stop: compare the steps recorded so far (at most once a second) and stop the
        jobs of a cell that diverged K steps ago. A reference job shared by several cells is
        stopped only once every cell using it has diverged, and never when it has a control."""
        now = time.time()
        if now - self._last_watch < 1.0:
            return
        self._last_watch = now
        k = self.sp.stop_after_divergence
        live = {(c.id, side): key for key, (_, c, side, _) in self.running.items()}
        for cell in self.cells:
            cid = cell.id
            if cid in self.early or cid in self.finished or cid not in self.selected:
                continue
            s = self.states.get(cid) or {}
            owner = self._owner(cid)
            cand = (s.get("sides") or {}).get("candidate", {}).get("status")
            ref = ("running" if (owner, "reference") in live
                   else (s.get("sides") or {}).get("reference", {}).get("status"))
            if cand not in ("running", OK) or ref not in ("running", OK) or cand == ref == OK:
                continue
            w = self.watches.get(cid)
            if w is None:
                ref_dir = (self._run_dir(cell, "reference") if owner == cid
                           else st.cell_dir(self.dir, owner) / "reference")
                w = self.watches[cid] = DivergenceWatch(
                    ref_dir, st.cell_dir(self.dir, cid) / "candidate", cell.world_size, k)
            hit = w.poll()
            if hit is None:
                continue
            self.early[cid] = hit
            self.progress.note(cid, f"diverged at step {hit[0]}; stopping after step {hit[1]} "
                                    f"(stop_after_divergence = {k})")
            if (cid, "candidate") in live:
                self._stop(live[(cid, "candidate")])
        for owner in {self._owner(c) for c in self.selected}:
            key = live.get((owner, "reference"))
            users = [owner, *self.sharers.get(owner, [])]
            if key is not None and key not in self.stopping and not self.sp.control and all(
                    u in self.early for u in users):
                self._stop(key)

    def _owner(self, cid: str) -> str:
        """The cell whose folder holds ``cid``'s reference job."""
        src = (self.states.get(cid, {}).get("sides") or {}).get("reference", {}).get(
            "shared_from")
        if src:
            return src
        return next((o for o, cs in self.sharers.items() if cid in cs), cid)

    def _stop(self, key: int) -> None:
        self.stopping.add(key)
        self.lnch.cancel(self.running[key][0])

    def _cancel_all(self) -> None:
        self.lnch.cancel_many([handle for handle, _, _, _ in self.running.values()])
        for key, (handle, cell, side, job) in list(self.running.items()):
            res = self.lnch.poll(handle)
            del self.running[key]
            if res is not None and side == ctl.CONTROL:
                self._control_done(cell, job, res)
            elif res is not None:
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
