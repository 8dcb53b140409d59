"""The `parity` command line: parse, call the library, map errors to exit codes.

Exit codes (the README has the full table):
  0 parity holds / the command did its job     1 parity does not hold (under --fail-on)
  2 bad input or usage                         3 incomplete data or a failed sweep cell
  4 internal error in parity (a bug: rerun with PARITY_DEBUG=1 for the traceback)
  130 interrupted
Heavy modules (torch, pandas) are imported inside the commands so `parity --help` stays fast.
"""

from __future__ import annotations

import os
import sys

import click

from parity.errors import EXIT_USAGE, ParityError

EXIT_INTERNAL = 4
FAIL_ON = click.Choice(["hash", "order", "any"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="parity", message="parity %(version)s")
def cli():
    """Prove a compiled distributed training job is bitwise identical to eager FSDP2."""


@cli.command("exec", context_settings={"ignore_unknown_options": True})
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory for this job's artifacts (created).")
@click.option("--every", default=1, show_default=True, type=click.IntRange(min=1),
              help="Record every N-th optimizer step (steps 0, 1 and the last step always).")
@click.option("--grads/--no-grads", default=True, show_default=True,
              help="Hash the gradients consumed by each optimizer step.")
@click.option("--manifests/--no-manifests", default=True, show_default=True,
              help="Record FSDP2 and compiled-graph bucket layouts.")
@click.option("--hasher", type=click.Choice(["auto", "xxh3", "device"]), default="auto",
              show_default=True, help="auto: device digest for CUDA tensors, xxh3 on the host otherwise.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_cmd(out_dir, every, grads, manifests, hasher, command):
    """Run COMMAND with capture active in every Python process it starts.

    \b
    Example:
      parity exec --out runs/eager -- torchrun --standalone --nproc_per_node 2 \\
          -m parity.workloads.train --mode eager
    The trainer needs no change. Exits with COMMAND's exit code (2 if it cannot be started;
    3 if it exits 0 but no rank recorded a step). Ends with a one-line summary on stderr.
    """
    from parity.capture.launch import exec_command

    sys.exit(exec_command(out_dir, list(command), every=every, grads=grads,
                          manifests=manifests, hasher=hasher))


@cli.command("diff")
@click.argument("a_dir", type=click.Path())
@click.argument("b_dir", type=click.Path())
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Also write the result as JSON (schema: parity/schemas/diff.schema.json).")
@click.option("--html", "html_file", type=click.Path(dir_okay=False),
              help="Also write a self-contained HTML report.")
@click.option("--fail-on", type=FAIL_ON, default="hash", show_default=True,
              help="What makes the exit code 1: hash mismatches, bucket-order differences, or any.")
def diff_cmd(a_dir, b_dir, json_file, html_file, fail_on):
    """Compare run B against reference run A (usually eager)."""
    from parity.diff import diff_runs
    from parity.report.console import make_console, print_diff
    from parity.report.stdout import print_safely

    result = diff_runs(a_dir, b_dir)
    code = result.exit_code(fail_on)
    # files first: a closed or full stdout must cost neither them nor the exit code
    if json_file:
        result.write_json(json_file)
    if html_file:
        from parity.report.html import write_diff_html

        write_diff_html(result, html_file)
    print_safely(lambda: print_diff(result, make_console()))
    sys.exit(code)


@cli.command("sweep")
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Sweep directory (default: reports/<spec name>).")
@click.option("--only", default=None, help="Run only cells matching e.g. 'flash=true,batch_size=4'.")
@click.option("--jobs", default=None, type=click.IntRange(min=1),
              help="Jobs run at once [default: 1 with the local launcher, all with slurm].")
@click.option("--resume", is_flag=True, help="Rerun only cells without a complete result.")
@click.option("--steps", default=None, type=click.IntRange(min=1), help="Override the spec's steps.")
@click.option("--dry-run", is_flag=True, help="Print the cells and commands; run nothing.")
@click.option("--launcher", type=click.Choice(["local", "slurm"]), default=None,
              help="Override the spec's launcher.")
@click.option("--fail-on", type=FAIL_ON, default="hash", show_default=True,
              help="Gate policy applied to the final verdict.")
def sweep_cmd(spec, out_dir, only, jobs, resume, steps, dry_run, launcher, fail_on):
    """Run paired reference/candidate jobs over a matrix and diff every cell.

    With no SPEC, runs the embedded CPU default (sweeps/cpu-default.toml).
    """
    from parity.sweep.runner import run_sweep

    sys.exit(run_sweep(spec, out_dir=out_dir, only=only, jobs=jobs, resume=resume, steps=steps,
                       dry_run=dry_run, launcher=launcher, fail_on=fail_on))


@cli.command("report")
@click.argument("sweep_dir", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["console", "json", "markdown", "junit", "html"]),
              default="console", show_default=True)
@click.option("--output", type=click.Path(dir_okay=False), help="Write to FILE instead of stdout.")
def report_cmd(sweep_dir, fmt, output):
    """Render a sweep's result."""
    from parity.report.formats import render_sweep

    render_sweep(sweep_dir, fmt, output)


@cli.command("gate")
@click.argument("sweep_dir", type=click.Path())
@click.option("--fail-on", type=FAIL_ON, default="hash", show_default=True)
def gate_cmd(sweep_dir, fail_on):
    """Exit 0 if every compared cell holds, 1 on a mismatch, 3 if a cell failed or is incomplete."""
    from parity.sweep.gate import gate

    sys.exit(gate(sweep_dir, fail_on))


def _usage_hint(e) -> str:
    ctx = getattr(e, "ctx", None)
    return f" (see '{ctx.command_path} --help')" if ctx is not None else ""


def main(argv: list[str] | None = None) -> None:
    """Entry point: one line on stderr and a documented exit code for every failure."""
    try:
        cli.main(args=argv, prog_name="parity", standalone_mode=False)
    except SystemExit as e:
        raise
    except ParityError as e:
        click.echo(f"parity: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("parity: interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("parity: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        msg = " ".join(e.format_message().split())  # one line, whatever click formatted
        click.echo(f"parity: error: {msg}" + ("" if isinstance(e, click.UsageError) and
                                               e.ctx is None else _usage_hint(e)), err=True)
        sys.exit(EXIT_USAGE)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # a bug in parity: still one line unless asked for more
        if os.environ.get("PARITY_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"parity: internal error: {e.__class__.__name__}: {msg} "
                   "(rerun with PARITY_DEBUG=1 for the traceback)", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(0)


if __name__ == "__main__":
    main()
