"""The launcher registry: a launcher by name. It imports the concrete launchers, which import
only the interface (launcher.py), so the dependency runs one way: runner -> launchers ->
launch_* -> launcher."""

from __future__ import annotations

from parity.errors import ParityError
from parity.sweep.launch_multinode import MultiNodeLauncher
from parity.sweep.launch_slurm import SlurmLauncher
from parity.sweep.launcher import Launcher

NAMES = ("local", "slurm")


def make_launcher(name: str, options: dict | None = None, grace: float = 5.0) -> Launcher:
    """The launcher called ``name`` ("local" | "slurm"), configured from the spec's table."""
    if name == "local":
        # One launcher for one node or several: a multi-node job runs one torchrun agent per
        # node on this machine (c10d rendezvous on 127.0.0.1), a one-node job as LocalLauncher.
        return MultiNodeLauncher(grace=grace)
    if name == "slurm":
        return SlurmLauncher(options or {}, grace=grace)
    raise ParityError(f"unknown launcher {name!r} ({', '.join(NAMES)})")
