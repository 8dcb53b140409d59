"""A real SLURM cluster on localhost for tests: munge + slurmctld + two slurmd (node1, node2).

Standard library only, so `.ci/slurm-up` can run it before any virtual environment exists:

    python3 tests/slurm_cluster.py up   [--dir DIR] [--no-install]  # prints one line
    python3 tests/slurm_cluster.py down [--dir DIR] [--remove]      # prints one line
    python3 tests/slurm_cluster.py status [--dir DIR]

From Python (tests): ``cluster = acquire()`` returns a running :class:`Cluster` or raises
:class:`Unavailable` with the reason to skip; ``cluster.env`` has ``SLURM_CONF`` for clients.
``acquire`` reuses a cluster that is already up (``PARITY_SLURM_CONF``, or the default
directory ``.ci/slurm-up`` uses, ``$PARITY_SLURM_DIR`` or /tmp/parity-slurm) and otherwise starts
a private one in a temporary directory that ``release`` stops. ``PARITY_SLURM=0`` disables.

Everything (munge key/socket, state, spool, logs, pid files) lives under one directory. Daemons
are stopped by their pid files, never by name. The two emulated nodes share this machine
(Debian's Slurm is built with MULTIPLE_SLURMD): ``NodeHostname=localhost NodeAddr=127.0.0.1``
and one port each; their names need not resolve (jobs read ``NodeAddr`` through scontrol), but
``up`` from the command line adds ``127.0.0.1 node1 node2`` to a writable ``/etc/hosts``, as on
a real cluster (``acquire`` in a test run does not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("PARITY_SLURM_DIR", "/tmp/parity-slurm"))
NODES = ("node1", "node2")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun", "munged",
            "mungekey")


class Unavailable(Exception):
    """SLURM cannot be used here; the message is the reason a test skips."""


def _which_all() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None
            and not Path("/usr/sbin", b).exists()]


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def install_packages(timeout: float = 300) -> str:
    """Install Debian's packages if a binary is missing. Returns what happened (one phrase)."""
    missing = _which_all()
    if not missing:
        return "packages present"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"SLURM binaries missing ({', '.join(missing)}) and cannot apt-get "
                          "install as non-root / without apt")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    t0 = time.monotonic()
    try:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True,
                       timeout=timeout, check=False)
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                            *PACKAGES], env=env, capture_output=True, text=True,
                           timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise Unavailable("apt-get install of SLURM timed out") from None
    missing = _which_all()
    if r.returncode != 0 or missing:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {tail[0]}")
    return f"installed {' '.join(PACKAGES)} in {time.monotonic() - t0:.1f} s"


def _free_ports(n: int, start: int = 17000, stop: int = 30000) -> int:
    """The first port p in [start, stop) with p..p+n-1 all free on 127.0.0.1 (bind test)."""
    p = start
    while p + n <= stop:
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("0.0.0.0", p + i))
                socks.append(s)
            return p
        except OSError:
            p += n + 1
        finally:
            for s in socks:
                s.close()
    raise Unavailable("no free ports for slurmctld/slurmd")


def _ensure_hosts() -> bool:
    """Add node names to /etc/hosts when writable; True if they resolve afterwards."""
    try:
        text = Path("/etc/hosts").read_text()
        names = {w for line in text.splitlines() if not line.lstrip().startswith("#")
                 for w in line.split()[1:]}
        missing = [n for n in NODES if n not in names]
        if missing:
            with open("/etc/hosts", "a") as f:
                f.write(f"127.0.0.1 {' '.join(missing)}  # parity tests/slurm_cluster.py\n")
    except OSError:
        pass
    try:
        return all(socket.gethostbyname(n) for n in NODES)
    except OSError:
        return False


def slurm_conf(d: Path, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    sock = d / "munge" / "munge.socket"
    return f"""\
# written by parity tests/slurm_cluster.py
ClusterName=parity
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{slurmd_port}-{slurmd_port + 1}] CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def _pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Cluster:
    dir: Path
    owned: bool = False  # started by this process: release() stops it
    started_in: float | None = None
    note: str = ""

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30, check: bool = False):
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def pidfiles(self) -> list[Path]:
        run = self.dir / "run"
        return [run / "munged.pid", run / "slurmctld.pid",
                *(run / f"slurmd-{n}.pid" for n in NODES)]

    def alive(self) -> bool:
        return self.conf.exists() and all(_pid_alive(p) for p in self.pidfiles())

    def nodes_ready(self) -> bool:
        try:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return False
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        return r.returncode == 0 and all(
            states.get(n, "") in ("idle", "mix", "alloc", "comp") for n in NODES)  # idle* = lost

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.nodes_ready():
                return
            time.sleep(0.2)
        log = self.dir / "log" / "slurmctld.log"
        tail = log.read_text().splitlines()[-5:] if log.exists() else []
        raise Unavailable(f"SLURM nodes not idle after {timeout:.0f} s; slurmctld.log: "
                          + " | ".join(tail))

    def start(self, cpus: int = 2) -> None:
        t0 = time.monotonic()
        d = self.dir
        for sub in ("munge", "state", "run", "log", *(f"spool/{n}" for n in NODES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        if not key.exists():
            subprocess.run([_bin("mungekey"), "--create", f"--keyfile={key}"], check=True,
                           capture_output=True)
            os.chmod(key, 0o400)
        sock = d / "munge" / "munge.socket"
        if not _pid_alive(d / "run" / "munged.pid"):
            r = subprocess.run(
                [_bin("munged"), f"--key-file={key}", f"--socket={sock}",
                 f"--pid-file={d}/run/munged.pid", f"--log-file={d}/log/munged.log",
                 f"--seed-file={d}/munge/munged.seed", "--force"],
                capture_output=True, text=True)
            if r.returncode != 0:
                raise Unavailable(f"munged failed: {r.stderr.strip()}")
        if not self.conf.exists() or not _pid_alive(d / "run" / "slurmctld.pid"):
            port = _free_ports(3)
            self.conf.write_text(slurm_conf(d, port, port + 1, cpus))
        env = self.env
        if not _pid_alive(d / "run" / "slurmctld.pid"):
            # -i: ignore missing state files on a first start.
            r = subprocess.run([_bin("slurmctld"), "-f", str(self.conf), "-i"], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise Unavailable(f"slurmctld failed: {r.stderr.strip()[-300:]}")
        for n in NODES:
            if not _pid_alive(d / "run" / f"slurmd-{n}.pid"):
                r = subprocess.run([_bin("slurmd"), "-f", str(self.conf), "-N", n], env=env,
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise Unavailable(f"slurmd -N {n} failed: {r.stderr.strip()[-300:]}")
        self.wait_ready()
        self.started_in = time.monotonic() - t0

    def cancel_jobs(self, wait: float = 15) -> int:
        """scancel every job of this cluster and wait (bounded) until the queue is empty, so that
        no job step outlives the daemons. Returns how many jobs were cancelled."""
        try:
            ids = self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()
            if ids:
                self.run("scancel", *ids, timeout=10)
            deadline = time.monotonic() + wait
            while ids and time.monotonic() < deadline:
                if not self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split():
                    break
                time.sleep(0.2)
            return len(ids)
        except (OSError, subprocess.SubprocessError):
            return 0

    def stop(self) -> list[str]:
        """Cancel the jobs, then stop the daemons by pid file (slurmd, slurmctld, munged);
        returns what was stopped."""
        stopped = []
        run = self.dir / "run"
        if _pid_alive(run / "slurmctld.pid") and self.conf.exists():
            n = self.cancel_jobs()
            if n:
                stopped.append(f"{n} job(s)")
        # All at once (each takes ~2 s to exit), then wait; SIGKILL after 5 s.
        pids = {}
        for pf in [*(run / f"slurmd-{n}.pid" for n in NODES), run / "slurmctld.pid",
                   run / "munged.pid"]:
            pid = _pid_alive(pf)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                    pids[pid] = pf.stem
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for pid, name in pids.items():
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.05)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            stopped.append(name)
        return stopped


def existing(conf: str | os.PathLike | None = None) -> Cluster | None:
    """A cluster that is already up: ``conf`` or ``$PARITY_SLURM_CONF`` or the default dir."""
    conf = conf or os.environ.get("PARITY_SLURM_CONF")
    d = Path(conf).parent if conf else DEFAULT_DIR
    c = Cluster(d)
    if c.conf.exists() and (c.alive() or conf) and c.nodes_ready():
        c.note = f"reused cluster at {c.conf}"
        return c
    return None


def up(d: Path = DEFAULT_DIR, install: bool = True, hosts: bool = True) -> Cluster:
    """Start (or find running) a cluster in ``d``; raises Unavailable with a reason.

    ``install``: apt-get the packages when missing; ``hosts``: add the node names to /etc/hosts
    (as on a real cluster; parity's jobs do not need it)."""
    c = existing(d / "slurm.conf")
    if c is not None:
        c.note = f"already running ({c.conf})"
        return c
    how = install_packages() if install else "packages present"
    if _which_all():
        raise Unavailable(f"SLURM binaries missing: {', '.join(_which_all())}")
    hosts = _ensure_hosts() if hosts else False
    c = Cluster(d, owned=True)
    try:
        c.start()
    except (OSError, subprocess.SubprocessError) as e:
        c.stop()
        raise Unavailable(f"cannot start SLURM: {e}") from None
    except Unavailable:
        c.stop()
        raise
    c.note = (f"{how}; munge + slurmctld + slurmd node1,node2 up in {c.started_in:.1f} s "
              f"({c.conf}{'; node1/node2 in /etc/hosts' if hosts else ''})")
    return c


_ACQUIRED: Cluster | None = None


def acquire(install: bool | None = None) -> Cluster:
    """A running cluster for tests (reused when one is up). Raises Unavailable with a reason.

    Packages are installed only in CI (``CI=true``) or with ``PARITY_SLURM_INSTALL=1``; a test
    run never edits /etc/hosts (``.ci/slurm-up`` does)."""
    global _ACQUIRED
    if _ACQUIRED is not None and _ACQUIRED.nodes_ready():
        return _ACQUIRED
    if os.environ.get("PARITY_SLURM", "") == "0":
        raise Unavailable("PARITY_SLURM=0: SLURM tests disabled")
    c = existing()
    if c is None:
        if install is None:
            install = os.environ.get("PARITY_SLURM_INSTALL",
                                     "1" if os.environ.get("CI") == "true" else "0") == "1"
        if not install and _which_all():
            raise Unavailable(f"SLURM is not installed ({', '.join(_which_all())} missing); run "
                              ".ci/slurm-up, or set PARITY_SLURM_INSTALL=1 to apt-get it")
        import tempfile

        c = up(Path(tempfile.mkdtemp(prefix="parity-slurm-")), install=install, hosts=False)
    _ACQUIRED = c
    return c


def release(c: Cluster | None = None) -> None:
    global _ACQUIRED
    c = c or _ACQUIRED
    if c is not None and c.owned:
        c.stop()
        shutil.rmtree(c.dir, ignore_errors=True)
    if c is _ACQUIRED:
        _ACQUIRED = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slurm_cluster.py", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--install", action=argparse.BooleanOptionalAction, default=True,
                   help="apt-get install the packages when missing (default: yes)")
    p.add_argument("--remove", action="store_true", help="down: also delete the directory")
    a = p.parse_args(argv)
    if a.action == "up":
        try:
            c = up(a.dir, install=a.install)
        except Unavailable as e:
            print(f"slurm-up: unavailable: {e}")
            return 1
        print(f"slurm-up: {c.note}; export SLURM_CONF={c.conf}")
        return 0
    c = Cluster(a.dir)
    if a.action == "down":
        stopped = c.stop()
        if a.remove and (a.dir / "slurm.conf").exists():
            shutil.rmtree(a.dir, ignore_errors=True)
        print(f"slurm-down: stopped {', '.join(stopped) or 'nothing'} ({a.dir}"
              f"{', removed' if a.remove else ''})")
        return 0
    ok = c.alive() and c.nodes_ready()
    print(f"slurm: {'up' if ok else 'down'} ({c.conf})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
