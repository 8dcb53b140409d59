"""A probe directory's layout (``parity nccl-probe --out DIR``)::

    DIR/logs/nccl.rank-NNNNN.log   every rank's NCCL_DEBUG=INFO log (NCCL_DEBUG_FILE)
    DIR/logs/nccl-graph.xml        rank 0's NCCL_GRAPH_DUMP_FILE (NCCL 2.6+)
    DIR/ranks/rank-NNNNN.json      what each rank measured (written before the analysis)
    DIR/probe.json                 every case, every rank's result, the analysis
    DIR/report.txt                 the report rank 0 printed
    DIR/topology.json              the topology file (parity diff --at, --emulate-nccl)
    DIR/job/                       with --spec: the launcher's console and per-rank logs
"""

from __future__ import annotations

PROBE_FILE = "probe.json"
TOPOLOGY_FILE = "topology.json"
REPORT_FILE = "report.txt"
LOGS_DIR = "logs"
RANKS_DIR = "ranks"
GRAPH_DUMP = "nccl-graph.xml"
PROBE_FORMAT = "parity-nccl-probe/1"


def log_name(rank: int) -> str:
    """Rank ``rank``'s NCCL log under LOGS_DIR."""
    return f"nccl.rank-{rank:05d}.log"
