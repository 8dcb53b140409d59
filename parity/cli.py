"""The `parity` command line: parse, call the library, map errors to exit codes.

Installed as the ``parity`` script; also ``python -m parity`` and, from a checkout, the
repository's top-level ``cli.py``. Verdicts and their words come from :mod:`parity.policy`.

Exit codes (the README has the full table):
  0 parity holds / the command did its job     1 parity does not hold (under --fail-on)
  2 bad input or usage                         3 incomplete data or a failed sweep cell
  4 internal error in parity (a bug: rerun with PARITY_DEBUG=1 for the traceback)
  130 interrupted
Heavy modules (torch, pandas) are imported inside the commands so `parity --help` stays fast.
"""

from __future__ import annotations

import errno
import os
import sys

import click

from parity import __version__
from parity.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, ParityError
from parity.policy import DEFAULT as DEFAULT_POLICY
from parity.policy import POLICIES
from parity.report.formats import FORMATS, formats_help, formats_titles
from parity.sweep.launchers import DEFAULT as DEFAULT_LAUNCHER
from parity.sweep.launchers import NAMES as LAUNCHERS

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
POLICY_HELP = ("What fails the verdict (exit 1): 'hash' a hash mismatch (bucket layout "
               "differences are reported, tolerated); 'any' a hash mismatch or a bucket layout "
               "difference; 'order-only' only a bucket layout difference (hash mismatches "
               "tolerated); 'reduction' a hash mismatch or a reduction-order difference (with "
               "--at, only one predicted at risk; copy-only all-gather differences tolerated).")
FAIL_ON = click.Choice(list(POLICIES))


def _exits(*rows: str) -> str:
    """An epilog listing a command's exit codes (kept as written: \b stops rewrapping)."""
    return "\b\nExit codes:\n" + "\n".join(f"  {r}" for r in rows)


EXIT_DIFF = _exits(
    "0  parity holds under --fail-on", "1  it does not (the verdict line says what failed it)",
    "2  bad input: unreadable or foreign directories, runs that cannot be compared,",
    "   an output file that cannot be written or would land in a recorded run or sweep",
    "3  incomplete: a side lacks ranks or steps, or --fail-on needs layouts a side lacks",
    "4  internal error in parity (PARITY_DEBUG=1 shows the "
    "traceback)")
EXIT_SWEEP = _exits(
    "0  every compared cell holds under --fail-on (skipped cells are listed)",
    "1  a compared cell does not", "2  bad spec, --only or directory",
    "3  a cell failed (crash, timeout) or nothing was compared", "4  internal error in parity",
    "130  interrupted: finished cells are kept, --resume completes the rest")


@click.group(context_settings=CONTEXT, epilog="\b\n" + "\n".join([
    "Exit codes: 0 holds, 1 does not hold, 2 bad input or usage, 3 incomplete or failed,",
    "4 internal error, 130 interrupted (each command's --help has its own).",
    "Shell completion (bash; zsh/fish: zsh_source/fish_source):",
    '  eval "$(_PARITY_COMPLETE=bash_source parity)"',
    "Docs: README.md, docs/diff.md, docs/sweep.md, docs/reliability.md."]))
@click.version_option(version=__version__, message="parity %(version)s")
def cli():
    """Prove a compiled distributed training job is bitwise identical to eager FSDP2.

    \b
    Typical use:
      parity exec --out runs/eager -- torchrun ... your_trainer.py   (and again for the candidate)
      parity diff runs/eager runs/compiled
      parity sweep                 the built-in CPU sweep; then parity report / parity gate
    """


def _run_owned() -> tuple[set[str], bool]:
    """What a run directory records: the names at its top that parity writes (rank folders
    aside, which ``rundir.rank_of`` names)."""
    from parity.capture.env import INTERRUPTED_FILE
    from parity.capture.launch import EMULATION_REFUSED_FILE, LOCK_FILE, STARTED_FILE
    from parity.rundir import NODES_DIR, OPS_DIR, RUN_FILE

    return {RUN_FILE, NODES_DIR, OPS_DIR, LOCK_FILE, STARTED_FILE, EMULATION_REFUSED_FILE,
            INTERRUPTED_FILE}, True


def _sweep_owned() -> tuple[set[str], bool]:
    """What a sweep directory owns (parity/sweep/state.py's layout); a report written beside it
    (SWEEP_DIR/report.html, report's html default) is not among them."""
    from parity.sweep.control import CONTROLS_DIR
    from parity.sweep.spec import CELLS_DIR
    from parity.sweep.state import LOCK_NAME, MARKER, SPEC_COPY, SWEEP_JSON

    return {SWEEP_JSON, CELLS_DIR, CONTROLS_DIR, MARKER, LOCK_NAME, SPEC_COPY}, False


def check_outputs(outputs: dict[str, str | None], runs=(), sweeps=(), own=None) -> None:
    """Refuse (ParityError, exit 2) before any work an output file that would overwrite a
    recorded result: a file a run records (rank-*/, run.json, nodes/, ...) of an input run in
    ``runs`` or of any run directory above it that ``parity exec`` wrote, a file a sweep owns
    (sweep.json, cells/, its marker, lock, spec copy, controls/) of a sweep in ``sweeps`` or
    above it, and two outputs of one command at the same path. ``outputs``: option -> path
    (None: not given). ``own``: the command's own output folder (bisect's, CELL_DIR/bisect by
    default), where a run or sweep above it does not own the files. Paths are compared
    resolved (a symlink is written at its target)."""
    from pathlib import Path

    from parity.capture.launch import LOCK_FILE
    from parity.rundir import rank_of
    from parity.sweep.state import MARKER

    given = {opt: path for opt, path in outputs.items() if path}
    if not given:
        return
    owners = [(Path(os.path.realpath(r)), "run", _run_owned()) for r in runs if r]
    owners += [(Path(os.path.realpath(w)), "sweep", _sweep_owned()) for w in sweeps if w]
    seen: dict[Path, str] = {}
    for opt, path in given.items():
        real = Path(os.path.realpath(path))
        if real in seen:
            raise ParityError(f"{seen[real]} and {opt} name the same file {path}; give each "
                              "its own")
        seen[real] = opt
        found = list(owners)
        for above in real.parents:  # runs and sweeps that parity wrote, whatever the inputs
            if (above / LOCK_FILE).is_file():
                found.append((above, "run", _run_owned()))
            if (above / MARKER).is_file():
                found.append((above, "sweep", _sweep_owned()))
        mine = Path(os.path.realpath(own)) if own else None
        for where, kind, (names, ranks) in found:
            try:
                first = real.relative_to(where).parts[0]
            except (ValueError, IndexError):
                continue
            if mine is not None and mine != where and where in mine.parents and (
                    mine == real or mine in real.parents):
                continue  # inside the command's own folder, below that run or sweep
            if first in names or ranks and rank_of(first) is not None:
                raise ParityError(f"{opt} {path}: refusing to write into the {kind} recorded in "
                                  f"{where} ({first} is the {kind}'s); write it elsewhere")


@cli.command("exec", context_settings={**CONTEXT, "ignore_unknown_options": True},
             short_help="Run a trainer (any command) with capture active in every rank.",
             epilog=_exits("N  COMMAND's own exit code", "2  COMMAND cannot be started (--force "
                          "then leaves the run in --out as it was), --out",
                          "   is empty, holds a run (no --force) or another parity exec writes "
                          "to it",
                          "3  COMMAND exited 0 but no rank recorded a step, or a second process "
                          "claimed a recorded rank"))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory for this job's artifacts (created; must not hold another run "
                   "unless --force; one parity exec at a time).")
@click.option("--every", default=1, show_default=True, type=click.IntRange(min=1),
              help="Record every N-th optimizer step (steps 0, 1 and the last step always).")
@click.option("--grads/--no-grads", default=True, show_default=True,
              help="Hash the gradients consumed by each optimizer step.")
@click.option("--manifests/--no-manifests", default=True, show_default=True,
              help="Record FSDP2 and compiled-graph bucket layouts (needed by --fail-on any).")
@click.option("--hasher", type=click.Choice(["auto", "xxh3", "device"]), default="auto",
              show_default=True,
              help="auto: device digest for CUDA tensors, xxh3 on the host otherwise.")
@click.option("--step-on", default=None, metavar="MODULE:FUNCTION",
              help="Count a step at each call of FUNCTION (a hand-written update, an optimizer "
                   "outside torch.optim); MODULE may be the trainer script's name "
                   "[default: none, an optimizer's step() is the step].")
@click.option("--emulate-nccl", "emulate_nccl", default=None, metavar="TOPOLOGY",
              help="NODESxGPUS[:channels=C]: sum every reduce-scatter and all-reduce of this "
                   "CPU/gloo job in NCCL's Ring order at that topology (changes the numbers; "
                   "docs/nccl-emulation.md). By default none: plain gloo.")
@click.option("--force", is_flag=True,
              help="Replace the run already in --out [default: refuse to touch it].")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_cmd(out_dir, every, grads, manifests, hasher, step_on, emulate_nccl, force, command):
    """Run COMMAND with capture active in every Python process it starts.

    \b
    Example:
      parity exec --out runs/eager -- torchrun --standalone --nproc_per_node 2 \\
          -m parity.workloads.train --mode eager
    The trainer needs no change. Step 0 is the initial parameters; step N the parameters after
    the N-th optimizer step (and the gradients that step consumed). Ends with a one-line
    summary on stderr (ranks and steps recorded, capture warnings).
    """
    from parity.capture.launch import exec_command

    sys.exit(exec_command(out_dir, list(command), every=every, grads=grads,
                          manifests=manifests, hasher=hasher, step_on=step_on,
                          emulate_nccl=emulate_nccl, force=force))


@cli.command("diff", context_settings=CONTEXT,
             short_help="Compare a candidate run with a reference run; one verdict line.",
             epilog=EXIT_DIFF)
@click.argument("a_dir", type=click.Path())
@click.argument("b_dir", type=click.Path())
@click.option("--json", "json_file", type=click.Path(),
              help="Also write the result as JSON to FILE (schema: "
                   "parity/schemas/diff.schema.json) [default: not written].")
@click.option("--html", "html_file", type=click.Path(),
              help="Also write a self-contained HTML page to FILE [default: not written].")
@click.option("--fail-on", type=FAIL_ON, default=DEFAULT_POLICY, show_default=True,
              help=POLICY_HELP)
@click.option("--at", "at", metavar="TOPOLOGY[,TOPOLOGY...]", multiple=True,
              help="Predict which gradient elements NCCL would sum in another rank order on "
                   "NODESxGPUS[:channels=C,...] (e.g. 8x8, 32x8:channels=16); several, one row "
                   "each: --at 1x8,2x8,8x8,32x8 (or --at repeated); docs/reduction-order.md "
                   "[default: no prediction].")
@click.option("--nccl-log", "nccl_log", type=click.Path(),
              help="Predict with the rings and channel choices of a real NCCL_DEBUG=INFO "
                   "(+TUNING) log [default: none].")
@click.option("--align-steps", "align_steps", metavar="none|auto|B+K|A+K", default="none",
              help="Pair steps other than by number: B+K compares B's step i with A's step K+i "
                   "(B resumed from a checkpoint of A's step K; A's earlier steps are said, not "
                   "compared; the reports use A's numbers), A+K the other way, auto the offset "
                   "the parameter digests prove on every rank (exit 2 where none is) "
                   "[default: none, by number].")
def diff_cmd(a_dir, b_dir, json_file, html_file, fail_on, at, nccl_log, align_steps):
    """Compare run B_DIR against reference run A_DIR (usually eager), both written by
    `parity exec --out`: first divergent step, divergent parameters and ranks, first differing
    bucket layout."""
    from parity.diff import diff_runs
    from parity.report.console import make_console, print_diff

    from parity.report.stdout import print_safely

    from parity.diff.reduction import topology_of

    check_outputs({"--json": json_file, "--html": html_file}, runs=(a_dir, b_dir))
    topo, notes = topology_of(list(at) or None, nccl_log)  # bad input: exit 2, before reading
    from parity.diff.align import parse as parse_align

    parse_align(align_steps)  # a malformed value: exit 2 before reading
    result = diff_runs(a_dir, b_dir, at=topo, align_steps=align_steps)
    ro = result.reduction_order
    for pred in (ro if isinstance(ro, list) else [ro] if ro is not None else []):
        pred.source = nccl_log or "model"
        pred.notes[:0] = notes
    code = result.exit_code(fail_on)
    # files first: a closed or full stdout must cost neither them nor the exit code
    if json_file:
        result.write_json(json_file)
    if html_file:
        from parity.report.html import write_diff_html

        write_diff_html(result, html_file, fail_on=fail_on)
    print_safely(lambda: print_diff(result, make_console(), fail_on))
    sys.exit(code)


@cli.command("inspect", context_settings=CONTEXT,
             short_help="One run's bucketing: collective counts, bucket sizes, spans, modules.",
             epilog=_exits("0  printed (a run without bucket manifests says so)",
                           "2  not a parity run directory, or --json FILE cannot be written or "
                           "would",
                           "   land among the run's recorded files",
                           "4  internal error in parity (PARITY_DEBUG=1 shows the traceback)"))
@click.argument("run_dir", type=click.Path())
@click.option("--json", "json_file", type=click.Path(),
              help="Also write the summary as JSON to FILE [default: not written].")
def inspect_cmd(run_dir, json_file):
    """Summarize the bucket manifests of RUN_DIR (written by `parity exec --out`): per graph and
    collective kind the count before and after the passes, bucket bytes, each bucket's span in
    the pre-pass graph, the compute nodes between reduce-scatters, and the parameters issued
    under a module that is not their owner. docs/inspect.md explains the figures."""
    from parity.artifacts import read_run, write_json_atomic
    from parity.diff.bucket_summary import summarize_run
    from parity.report.bucket_summary import print_summary
    from parity.report.console import make_console

    from parity.report.stdout import print_safely

    check_outputs({"--json": json_file}, runs=(run_dir,))
    summary = summarize_run(read_run(run_dir))
    if json_file:  # files first: a closed stdout must not cost them
        write_json_atomic(json_file, summary or {"graphs": [], "attribution": []})
    print_safely(lambda: print_summary(summary, make_console()))


EXIT_BISECT = ("\b\nExit codes:\n"
               "  0  no aligned op differs at that step (or the runs do not diverge)\n"
               "  1  a differing op is named\n"
               "  2  a side cannot be rerun (the line names why), bad usage, unknown cell,\n"
               "     --rank/--step not in the recorded runs\n"
               "  3  a rerun failed or recorded no ops at that step, or the pair is incomplete\n"
               "     (no divergent step is known)\n"
               "  4  internal error in parity\n"
               "  130  interrupted")


@cli.command("bisect", context_settings=CONTEXT,
             short_help="Rerun both sides to the divergent step; name the first differing op.",
             epilog=EXIT_BISECT)
@click.argument("a_dir", type=click.Path())
@click.argument("b_dir", required=False, type=click.Path())
@click.option("--cell", default=None,
              help="With a sweep directory: the cell to bisect [default: none, give A_DIR B_DIR].")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="Step to look at [default: the first divergent step].")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Rank to report in detail [default: the first divergent rank].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where the reruns and bisect.json go [default: ./parity-bisect, or "
                   "CELL_DIR/bisect].")
@click.option("--json", "json_file", type=click.Path(),
              help="Also write the report (bisect.json) to FILE [default: only OUT/bisect.json].")
def bisect_cmd(a_dir, b_dir, cell, step, rank, out_dir, json_file):
    """Rerun A and B up to the divergent step and name the first operation whose output differs.

    \b
    parity bisect A_DIR B_DIR [--step K] [--rank R]
    parity bisect SWEEP_DIR --cell ID
    docs/bisect.md explains the output.
    """
    from pathlib import Path

    from parity.bisect import bisect, format_report, sweep_sides

    if out_dir == "":
        raise ParityError("bisect: --out is empty; give a directory, or leave --out out "
                          "(SWEEP_DIR/bisect, else ./parity-bisect)")
    envs = ({}, {})
    if cell is not None:
        if b_dir is not None:
            raise ParityError("bisect: give SWEEP_DIR --cell ID, or A_DIR B_DIR, not both")
        a_dir, b_dir, side_env = sweep_sides(Path(a_dir), cell)
        envs = (side_env.get("reference", {}), side_env.get("candidate", {}))
        out_dir = out_dir or str(Path(a_dir).parent / "bisect")
    elif b_dir is None:
        raise ParityError("bisect: give A_DIR B_DIR, or SWEEP_DIR --cell ID")
    check_outputs({"--json": json_file}, runs=(a_dir, b_dir), own=out_dir or "parity-bisect")
    code, report = bisect(a_dir, b_dir, out_dir=out_dir or "parity-bisect", step=step, rank=rank,
                          envs=envs, say=lambda m: click.echo(m, err=True))
    if json_file:
        from parity.artifacts import write_json_atomic

        write_json_atomic(json_file, report)
    from parity.report.stdout import print_safely

    print_safely(lambda: click.echo(format_report(report)))
    sys.exit(code)


@cli.command("sweep", context_settings=CONTEXT,
             short_help="Run reference/candidate job pairs over a matrix, diff every cell.",
             epilog=EXIT_SWEEP)
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Sweep directory [default: reports/<spec name>].")
@click.option("--only", default=None, metavar="AXIS=V[|V2],...",
              help="Run only the cells matching every AXIS=VALUE given; '|' separates the "
                   "values of one axis, e.g. --only 'flash=true,batch_size=1|4' [default: all].")
@click.option("--jobs", default=None, type=click.IntRange(min=1),
              help="Jobs run at once [default: 1 with the local launcher, all with slurm].")
@click.option("--resume", is_flag=True,
              help="Keep cells with a complete result in --out; run the others.")
@click.option("--steps", default=None, type=click.IntRange(min=1),
              help="Optimizer steps per job [default: the spec's steps].")
@click.option("--dry-run", is_flag=True, help="Print the cells and commands; run nothing.")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default=None,
              help="Where jobs run [default: the spec's [launcher] type, else "
                   f"{DEFAULT_LAUNCHER}].")
@click.option("--fail-on", type=FAIL_ON, default=DEFAULT_POLICY, show_default=True,
              help=POLICY_HELP + " Recorded in sweep.json: report and gate default to it.")
@click.option("--control", is_flag=True,
              help="Determinism control: run each distinct reference job twice and diff the "
                   "repeat; a reference that differs from itself makes its cells "
                   "'nondeterministic' [default: the spec's control key].")
def sweep_cmd(spec, out_dir, only, jobs, resume, steps, dry_run, launcher, fail_on, control):
    """Run paired reference/candidate jobs over a matrix, diff every cell, end with the gate's
    verdict line.

    With no SPEC, runs the embedded default: sweeps/cuda-default.toml on a machine with a CUDA
    device, sweeps/cpu-default.toml elsewhere (eager FSDP2 vs a compiled SimpleFSDP-style job,
    2 ranks each). docs/sweep.md has the spec format.
    """
    from parity.report.formats import print_sweep_console
    from parity.report.stdout import print_safely
    from parity.sweep.gate import evaluate
    from parity.sweep.model import as_report
    from parity.sweep.runner import run_sweep

    if out_dir == "":  # as exec: an empty --out is a mistake, not the default folder
        raise ParityError("sweep: --out is empty; give a directory, or leave --out out "
                          "(reports/<spec name>)")
    sweep = run_sweep(spec, out_dir=out_dir, only=only, jobs=jobs, resume=resume, steps=steps,
                      dry_run=dry_run, launcher=launcher, fail_on=fail_on, control=control)
    if sweep is None:  # --dry-run: the plan is printed, nothing ran
        sys.exit(EXIT_OK)
    report = as_report(sweep)  # typed once; the gate and the console read it
    code, _ = evaluate(report, fail_on)
    # the console report ends with the gate's verdict line
    print_safely(lambda: print_sweep_console(report, sys.stdout, fail_on=fail_on))
    sys.exit(code)


@cli.command("report", context_settings=CONTEXT,
             short_help=f"Render a sweep: {formats_titles()}.",
             epilog=_exits("0  rendered (the verdict is the gate's exit code, not this one)",
                           "2  not a sweep directory, or --output cannot be written or is a "
                           "file",
                           "   the sweep owns (sweep.json, cells/, ...)",
                           "4  internal error in parity"))
@click.argument("sweep_dir", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="console",
              show_default=True, help=formats_help())
@click.option("--output", type=click.Path(),
              help="Write to FILE [default: stdout; html: SWEEP_DIR/report.html].")
@click.option("--fail-on", type=FAIL_ON, default=None,
              help="Policy for the verdict, JUnit failures and markdown [default: the sweep's "
                   "own --fail-on, recorded in sweep.json].")
def report_cmd(sweep_dir, fmt, output, fail_on):
    """Render the sweep in SWEEP_DIR (written by `parity sweep --out`)."""
    from parity.report.formats import render_sweep
    from parity.sweep.state import load_report

    report = load_report(sweep_dir)  # read and typed once
    check_outputs({"--output": output}, sweeps=(report.dir,))
    render_sweep(report, fmt, output, fail_on=fail_on)


@cli.command("gate", context_settings=CONTEXT,
             short_help="The CI verdict over a sweep directory: exit 0, 1 or 3.",
             epilog=_exits("0  every compared cell holds under --fail-on (tolerated and skipped "
                           "cells are listed)", "1  a compared cell fails it",
                           "2  not a sweep directory",
                           "3  a cell failed, the sweep did not finish, or nothing was compared",
                           "4  internal error in parity"))
@click.argument("sweep_dir", type=click.Path())
@click.option("--fail-on", type=FAIL_ON, default=None,
              help=POLICY_HELP + " [default: the sweep's own --fail-on, recorded in sweep.json]")
def gate_cmd(sweep_dir, fail_on):
    """Print one line per notable cell and the verdict line; exit with the verdict."""
    from parity.report.stdout import print_safely
    from parity.sweep.gate import gate

    code, lines = gate(sweep_dir, fail_on)
    print_safely(lambda: sys.stdout.write("".join(line + "\n" for line in lines)))
    sys.exit(code)


@cli.command("nccl-probe", context_settings=CONTEXT,
             short_help="Check the NCCL reduction-order model on this cluster, bit for bit.",
             epilog=_exits(
                 "0  in a job: the probe ran and wrote DIR (whatever the agreement); with "
                 "--report or --spec: every modelled case agrees with the model",
                 "1  with --report or --spec: a case disagrees (the model does not hold here)",
                 "2  bad input: options, topology, not inside a job, DIR holds a probe",
                 "3  the job failed, or no case could be checked (--report, --spec)",
                 "4  internal error in parity (PARITY_DEBUG=1 shows the traceback)"))
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Probe directory: logs/, ranks/, probe.json, report.txt and topology.json "
                   "(must be on a filesystem every node sees for the logs to be kept whole).")
@click.option("--emulate-nccl", "emulate_nccl", metavar="TOPOLOGY",
              help="Run on gloo with every reduction summed as the model says at TOPOLOGY "
                   "(NODESxGPUS[:...] or a topology.json) instead of on NCCL: for tests and "
                   "CPU machines [default: NCCL].")
@click.option("--model", metavar="TOPOLOGY",
              help="Check the model at this topology instead of the one rebuilt from the "
                   "cluster's logs (e.g. 2x8:nics=8 to test parity's assumptions without a log) "
                   "[default: the cluster's].")
@click.option("--sizes", default="1K-256M", show_default=True,
              help="Input bytes per rank: LO-HI (every power of two), a comma list, or both.")
@click.option("--sizes-from", "sizes_from", type=click.Path(),
              help="Also probe the exact reduce-scatter and all-reduce buckets of this recorded "
                   "run (parity exec --out) [default: none].")
@click.option("--collectives", default="reduce_scatter,all_reduce", show_default=True)
@click.option("--ops", default="sum,avg", show_default=True,
              help="sum, avg (NCCL's PreMulSum for floats).")
@click.option("--dtypes", default="fp32,bf16", show_default=True)
@click.option("--repeat", default=2, show_default=True, type=click.IntRange(1, 100),
              help="Run every case this many times and compare the outputs.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds a collective may wait for the other ranks.")
@click.option("--force", is_flag=True, help="Replace a probe already in --out.")
@click.option("--spec", "spec", type=click.Path(dir_okay=False),
              help="Start the probe job yourself with this sweep spec's launcher (local or "
                   "slurm), nnodes x nproc_per_node, env and timeout, wait, and report "
                   "[default: run as one rank of the job this command is in].")
@click.option("--report", "report_dir", type=click.Path(file_okay=False),
              help="Print the report of a finished probe directory and exit with its verdict.")
def nccl_probe_cmd(out_dir, emulate_nccl, model, sizes, sizes_from, collectives, ops, dtypes,
                   repeat, seed, timeout, force, spec, report_dir):
    """Run reduce-scatters and all-reduces of seeded inputs on every rank, compare NCCL's bits
    with the model's, and write DIR/topology.json for `parity diff --at` and
    `parity exec --emulate-nccl`.

    \b
    Inside a job (every rank runs it):
      torchrun --nnodes 2 --nproc_per_node 8 ... -m parity nccl-probe --out probe
      srun -N2 --ntasks-per-node 8 --gpus-per-node 8 parity nccl-probe --out probe
    On CPU (4 gloo ranks, the model's own sums at 2x2):
      torchrun --standalone --nproc_per_node 4 -m parity nccl-probe --out probe \\
          --emulate-nccl 2x2:channels=4 --sizes 1K-64K
    docs/nccl-probe.md explains every figure.
    """
    from parity.probe import cases as pc

    if report_dir:
        from pathlib import Path

        from parity.probe.analysis import load, report_lines, verdict_code
        from parity.report.stdout import print_safely

        record = load(report_dir)
        lines = report_lines(record, record["analysis"], Path(report_dir).resolve())
        print_safely(lambda: click.echo("\n".join(lines)))
        sys.exit(verdict_code(record["analysis"]["agreement"]))
    if not out_dir:
        raise ParityError("nccl-probe: give --out DIR (or --report DIR)")
    parsed = dict(sizes=pc.parse_sizes(sizes),
                  collectives=pc.parse_choice(collectives, pc.COLLECTIVES, "--collectives"),
                  ops=pc.parse_choice(ops, pc.OPS, "--ops"),
                  dtypes=pc.parse_choice(dtypes, tuple(pc.DTYPES), "--dtypes",
                                         pc.DTYPE_ALIASES))
    from parity.nccl import parse_topology

    for text in (emulate_nccl, model):
        if text:
            parse_topology(text)  # one line, exit 2, before any job starts
    if spec:
        from parity.probe.launch import launch

        passed = ["--sizes", sizes, "--collectives", collectives, "--ops", ops, "--dtypes",
                  dtypes, "--repeat", str(repeat), "--seed", str(seed), "--timeout",
                  str(timeout)]
        def where(text):  # the job may run elsewhere (the spec's workdir): absolute paths
            return os.path.abspath(text) if text and os.path.exists(text) else text

        for flag, value in (("--model", where(model)), ("--sizes-from", where(sizes_from))):
            if value:
                passed += [flag, value]
        if force:
            passed.append("--force")
        sys.exit(launch(spec, out_dir, passed, where(emulate_nccl)))
    from parity.probe.rank import Options, run

    opts = Options(out=out_dir, emulate=emulate_nccl, model=model, sizes_from=sizes_from,
                   repeat=repeat, seed=seed, timeout=timeout, force=force,
                   argv=["parity", *sys.argv[1:]], **parsed)
    sys.exit(run(opts))


def _usage_hint(e) -> str:
    ctx = getattr(e, "ctx", None)
    return f" (see '{ctx.command_path} --help')" if ctx is not None else ""


def debug_enabled() -> bool:
    """PARITY_DEBUG set to a true value (1, true, yes, on): internal errors show their traceback.
    Anything else ("0", "", "no") is off."""
    return os.environ.get("PARITY_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> None:
    """Entry point: one line on stderr and a documented exit code for every failure. A closed
    or full stdout never changes the exit code (report/stdout.py)."""
    from parity.report.stdout import watch_stdout

    with watch_stdout():  # leaving it flushes stdout: a full one costs one line, not the code
        code = _main(argv)
    sys.exit(code)


def _main(argv: list[str] | None) -> int | str | None:
    """Run the command; the exit code (a SystemExit's code as the command gave it)."""
    from parity.report.stdout import stdout_error, stdout_failure
    from parity.report.text import safe_text

    try:
        cli.main(args=argv, prog_name="parity", standalone_mode=False)
    except SystemExit as e:
        if type(sys.stdout).__name__ == "_PacifyFlushWrapper" and e.code == 1:
            # click's own path for an EPIPE (--help | head -1): it exits 1. Stdout's: the
            # command did its job (the verdict commands print through print_safely and never
            # get here); another pipe's is a bug, not a verdict
            closed = stdout_error()
            if closed is not None and closed.errno == errno.EPIPE:
                stdout_failure(closed)  # fd 1 to /dev/null: the last flush must not fail
                return EXIT_OK
            _say("parity: internal error: BrokenPipeError: a pipe other than stdout was closed "
                 "(rerun with PARITY_DEBUG=1 for the traceback)")
            return EXIT_INTERNAL
        return e.code
    except ParityError as e:  # one line, whatever the message holds (a path with a newline)
        _say(f"parity: error: {safe_text(e)}")
        return e.exit_code
    except click.exceptions.Abort:
        _say("parity: interrupted")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        _say("parity: interrupted")
        return EXIT_INTERRUPTED
    except click.ClickException as e:
        msg = safe_text(" ".join(e.format_message().split()))  # one line, whatever click made
        _say(f"parity: error: {msg}" + ("" if isinstance(e, click.UsageError) and
                                        e.ctx is None else _usage_hint(e)))
        return EXIT_USAGE
    except Exception as e:  # a bug in parity: still one line unless asked for more
        if isinstance(e, OSError) and stdout_failure(e):
            # stdout closed or full outside print_safely (click's --help, a dry run's plan):
            # the command did its job; what it printed is a convenience (one line when full)
            return EXIT_OK
        debug = debug_enabled()
        if debug:  # the traceback, then the line; the exit code stays the documented 4
            import traceback

            traceback.print_exc()
        msg = str(e).splitlines()[0] if str(e) else ""
        _say(f"parity: internal error: {e.__class__.__name__}: {safe_text(msg)} " +
             ("(traceback above)" if debug else "(rerun with PARITY_DEBUG=1 for the traceback)"))
        return EXIT_INTERNAL
    return EXIT_OK


def _say(line: str) -> None:
    """One line on stderr; a closed stderr loses it, not the exit code."""
    try:
        click.echo(line, err=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
