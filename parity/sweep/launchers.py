"""The launcher registry: the one place launcher names live. The spec's ``[launcher] type``,
``parity sweep --launcher``'s choices and the runner read :data:`NAMES` and the constants here;
``make_launcher`` builds the launcher called by a name and gives it that name.

A factory imports its launcher's module when called (the concrete launchers import only the
interface, launcher.py), so the CLI and the spec parser read the names without loading them;
the dependency runs one way: runner -> launchers -> launch_* -> launcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from parity.errors import ParityError

if TYPE_CHECKING:  # the interface imports shutil & co.: the CLI reads NAMES without them
    from parity.sweep.launcher import Launcher

LOCAL = "local"  # this machine: one torchrun agent per node (launch_multinode.MultiNodeLauncher)
SLURM = "slurm"  # sbatch jobs (launch_slurm.SlurmLauncher)
DEFAULT = LOCAL  # a spec without a [launcher] table


def _local(options: dict, grace: float) -> Launcher:
    # One launcher for one node or several: a multi-node job runs one torchrun agent per node
    # on this machine (c10d rendezvous on 127.0.0.1), a one-node job as LocalLauncher.
    from parity.sweep.launch_multinode import MultiNodeLauncher

    return MultiNodeLauncher(grace=grace)


def _slurm(options: dict, grace: float) -> Launcher:
    from parity.sweep.launch_slurm import SlurmLauncher

    return SlurmLauncher(options, grace=grace)


# name -> factory(options from the spec's [launcher] table, grace seconds)
LAUNCHERS: dict[str, Callable[[dict, float], "Launcher"]] = {LOCAL: _local, SLURM: _slurm}
NAMES = tuple(LAUNCHERS)


def make_launcher(name: str, options: dict | None = None, grace: float = 5.0) -> Launcher:
    """The launcher called ``name`` (one of :data:`NAMES`), configured from the spec's table."""
    factory = LAUNCHERS.get(name)
    if factory is None:
        raise ParityError(f"unknown launcher {name!r} ({', '.join(NAMES)})")
    launcher = factory(options or {}, grace)
    launcher.name = name  # what a `launcher:NAME` requirement is checked against
    return launcher
