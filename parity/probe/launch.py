"""``parity nccl-probe --spec SPEC``: start the probe job with a sweep spec's launcher and wait.

Why: a team that already runs its sweeps on SLURM has the allocation written down once, in the
spec's ``[launcher]`` table (partition, account, GPUs per node, time) and its ``nnodes`` x
``nproc_per_node``. The probe reuses that: one job, uncaptured (``capture = False``: the probe is
not a trainer), whose entry is ``-m parity nccl-probe --out DIR ...`` under torchrun on every
node, started by the same launcher a sweep cell would get (parity.sweep.launchers: ``local``
runs one torchrun agent per node on this machine, ``slurm`` one ``sbatch`` job with one agent
per node). The spec's ``env``, ``timeout``, ``workdir`` and ``emulate_nccl`` apply. When the job
has ended, its report is read back from DIR and the verdict is the exit code.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from parity.errors import EXIT_INCOMPLETE, ParityError
from parity.probe.files import PROBE_FILE
from parity.sweep.launcher import OK, Job
from parity.sweep.launchers import make_launcher
from parity.sweep.spec import check_workdir, load_spec

JOB_LOGS = "job"  # DIR/job/: the launcher's console, torchrun's per-rank logs, SLURM files


def probe_job(spec, out: Path, probe_args: list[str]) -> Job:
    """The probe as one launcher job of the spec's shape."""
    logs = out / JOB_LOGS
    return Job(cell_id="nccl-probe", side="probe",
               entry_argv=["-m", "parity", "nccl-probe", "--out", str(out), *probe_args],
               nnodes=spec.nnodes, nproc_per_node=spec.nproc_per_node, env=dict(spec.env),
               run_dir=logs / "run", log_dir=logs / "ranks", timeout=spec.timeout,
               console_log=logs / "console.log", cwd=spec.workdir, capture=False)


def launch(spec_path: str, out: str, probe_args: list[str], emulate: str | None,
           say=lambda m: print(m, file=sys.stderr, flush=True)) -> int:
    """Run the probe job; returns the verdict's exit code (parity.probe.analysis.verdict_code),
    or 3 when the job failed. Before anything starts: the spec's ``workdir`` must be a directory
    and ``out`` must not hold a probe unless ``--force`` is among ``probe_args`` (exit 2)."""
    from parity.probe.analysis import load, report_lines, verdict_code

    spec = load_spec(spec_path)
    check_workdir(spec)
    out_p = Path(out).resolve()
    if "--force" not in probe_args and (out_p / PROBE_FILE).exists():
        # the ranks would refuse it too, but only after the job started (and then the job's
        # failure, exit 3, hides why): said here, before anything is launched
        raise ParityError(f"nccl-probe: {out_p} already holds a probe ({PROBE_FILE}); give "
                          "--force or another --out")
    emulate = emulate or spec.emulate_nccl
    if emulate:
        probe_args = [*probe_args, "--emulate-nccl", emulate]
    job = probe_job(spec, out_p, probe_args)
    out_p.mkdir(parents=True, exist_ok=True)
    launcher = make_launcher(spec.launcher.type, spec.launcher.options)
    reason = launcher.unsupported(job.nnodes, job.nproc_per_node)
    if reason:
        raise ParityError(f"nccl-probe --spec {spec_path}: {reason}")
    say(f"parity: nccl-probe: {spec.nnodes} node(s) x {spec.nproc_per_node} rank(s) with the "
        f"{spec.launcher.type} launcher of {spec_path}; logs in {out_p / JOB_LOGS}")
    handle = launcher.start(job)
    try:
        while (result := launcher.poll(handle)) is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        launcher.cancel(handle)
        raise
    finally:
        launcher.close()
    if result.status != OK:
        say(f"parity: nccl-probe: the job {result.status}: {result.reason or 'no reason given'} "
            f"(console: {result.console_log})")
        return EXIT_INCOMPLETE
    record = load(out_p)
    sys.stdout.write("\n".join(report_lines(record, record["analysis"], out_p)) + "\n")
    return verdict_code(record["analysis"]["agreement"])
