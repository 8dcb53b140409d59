"""The machines a probe ran on: hosts, GPUs per host, NICs, NCCL version, from what every rank
reported about itself and what NCCL printed at init.

NICs are read from each host's first rank log (``NCCL_DEBUG_SUBSYS=INIT``):

* ``Using network IB`` (``initTransportsRank`` in ``src/init.cc``): the network plug-in;
* ``NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB ib0:10.0.0.1<0>``
  (``ncclIbInit`` in ``src/transport/net_ib.cc``) and ``NET/Socket : Using [0]eth0:10.0.0.1<0>``
  (``ncclNetSocketInit`` in ``src/transport/net_socket.cc``): one ``[i]name`` per device.

A plug-in that prints its devices otherwise (aws-ofi-nccl, ...) leaves the count unknown (said).
Standard library only.
"""

from __future__ import annotations

import re

_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")
_DEVICES = re.compile(r"NCCL INFO NET/(\w+) ?: Using((?: \[\d+\][^\s;]+)+)")
_DEVICE = re.compile(r"\[(\d+)\]([^\s;:]+)")


def nics_of(text: str) -> tuple[str | None, list[str]]:
    """(network name, device names) an NCCL INIT log shows (the last report of each)."""
    network, devices = None, []
    for m in _NETWORK.finditer(text):
        network = m.group(1)
    found: dict[str, list[str]] = {}
    for m in _DEVICES.finditer(text):
        found[m.group(1)] = [d for _, d in _DEVICE.findall(m.group(2))]
    if found:
        devices = found.get(network) or found.get("IB") or next(iter(found.values()))
    return network, devices


def describe(metas: list[dict], logs: dict[int, str]) -> dict:
    """Hosts (in rank order), their ranks, GPUs and NICs, and what every host agrees on."""
    hosts: dict[str, dict] = {}
    for m in sorted(metas, key=lambda m: m.get("rank", 0)):
        h = hosts.setdefault(m.get("host", "?"), {"host": m.get("host", "?"), "ranks": [],
                                                 "gpus": {}, "network": None, "nics": None})
        h["ranks"].append(m.get("rank"))
        if m.get("gpu"):
            h["gpus"][str(m.get("local_rank"))] = m["gpu"]
        if h["nics"] is None and logs.get(m.get("rank")):
            network, devices = nics_of(logs[m["rank"]])
            if network or devices:
                h["network"], h["nics"] = network, devices
    versions = sorted({m["nccl_version"] for m in metas if m.get("nccl_version")})
    nic_counts = {len(h["nics"]) for h in hosts.values() if h["nics"]}
    out = {"hosts": list(hosts.values()), "host_count": len(hosts),
           "ranks_per_host": sorted({len(h["ranks"]) for h in hosts.values()}),
           "gpu_models": sorted({g for h in hosts.values() for g in h["gpus"].values()}),
           "nccl_versions": versions,
           "torch": sorted({m["torch"] for m in metas if m.get("torch")}),
           "nics_per_host": nic_counts.pop() if len(nic_counts) == 1 else None,
           "networks": sorted({h["network"] for h in hosts.values() if h["network"]}),
           "env": _common_env(metas)}
    return out


def _common_env(metas: list[dict]) -> dict[str, str]:
    """NCCL_* settings every rank had (set by the user, or by the probe)."""
    envs = [m.get("env") or {} for m in metas]
    if not envs:
        return {}
    return {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
