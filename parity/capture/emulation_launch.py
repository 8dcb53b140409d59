"""``parity exec --emulate-nccl``, the launcher side: validate the topology and, where the command
line says how many ranks torchrun starts, refuse a world size that is not NODES x GPUS before
anything runs (each rank checks again: nccl_emulation.py). Import-light (no torch): it runs in
the ``parity exec`` process."""

from __future__ import annotations

import os

from parity.errors import ParityError
from parity.nccl import parse_topology

_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path",
                   "--run_path", "--virtual-local-rank", "--virtual_local_rank"}


def torchrun_world(command: list[str]) -> int | None:
    """nnodes x nproc_per_node of a torchrun command line, or None when it does not say (not
    torchrun, elastic ``--nnodes 1:4``, ``--nproc_per_node gpu``)."""
    i = None
    for k, tok in enumerate(command):
        if os.path.basename(tok) == "torchrun":
            i = k + 1
            break
        if tok in ("torch.distributed.run", "torch.distributed.launch") and k and \
                command[k - 1] == "-m":
            i = k + 1
            break
    if i is None:
        return None
    opts: dict[str, str] = {}
    while i < len(command) and command[i].startswith("-"):
        tok = command[i]
        if "=" in tok:
            key, _, val = tok.partition("=")
            opts[key.replace("-", "_").lstrip("_")] = val
            i += 1
        elif tok in _TORCHRUN_FLAGS:
            i += 1
        else:
            if i + 1 < len(command):
                opts[tok.replace("-", "_").lstrip("_")] = command[i + 1]
            i += 2
    nproc, nnodes = opts.get("nproc_per_node", "1"), opts.get("nnodes", "1")
    if not (nproc.isdigit() and nnodes.isdigit()):
        return None
    return int(nproc) * int(nnodes)


def check_emulation(spec: str, command: list[str]) -> str:
    """The canonical topology text for ``spec``; ParityError (exit 2) if it does not parse or
    the command starts a different number of ranks."""
    topo = parse_topology(spec)
    world = torchrun_world(command)
    if world is not None and world != topo.world:
        raise ParityError(f"--emulate-nccl {topo.spec()} needs {topo.world} ranks (NODES x GPUS); "
                          f"the command starts {world}")
    return topo.spec()
