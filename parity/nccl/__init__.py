"""What parity knows about NCCL: its reduction order, per release, read from its sources.

One package, a module per concern, each rule next to the source it cites:

* :mod:`parity.nccl.versions`  NCCL releases -> the rule family each follows;
* :mod:`parity.nccl.topology`  ``NODESxGPUS[:channels=C,nics=N,proto=P,nccl=X.Y,algo=Ring]``
  and topology files;
* :mod:`parity.nccl.channels`  the channel cut and the four split families;
* :mod:`parity.nccl.chunking`  Ring all-reduce chunks and their owners;
* :mod:`parity.nccl.rings`     rings as clusters build them, channel counts, sum orders;
* :mod:`parity.nccl.logs`      ``NCCL_DEBUG=INFO`` logs: communicators, rings, TUNING rows;
* :mod:`parity.nccl.api`       ``predict`` and the names the diff, the emulation and the CLI use.

Import from here (``from parity.nccl import predict, parse_topology``); the public API is
documented in docs/reduction-order.md.
"""

from parity.nccl.api import (MODEL, MODEL_LIMITS, Prediction, Scenario, Segment, Unknown,
                             all_reduce_segments, channel_count, communicator_channels,
                             default_channels,
                             orders_differ, parse_list, predict, primary_scenario,
                             reduce_scatter_segments, ring_families, rings)
from parity.nccl.channels import (ALL_REDUCE, LL, LL128, PROTOCOLS, REDUCE_SCATTER, SIMPLE,
                                  channel_cut, channel_split)
from parity.nccl.chunking import ring_index
from parity.nccl.logs import CommLog, NcclLog, parse_nccl_log, read_log, topology_from_log
from parity.nccl.rings import RingFamily, canonical_order, same_sum, sum_order
from parity.nccl.topology import (Topology, TuningRow, load_topology, parse_topology,
                                  save_topology)
from parity.nccl.versions import NEWEST, OLDEST, Rules, rules_for

__all__ = [
    "ALL_REDUCE", "CommLog", "LL", "LL128", "MODEL", "MODEL_LIMITS", "NEWEST", "NcclLog", "OLDEST",
    "PROTOCOLS", "Prediction", "REDUCE_SCATTER", "RingFamily", "Rules", "SIMPLE", "Scenario",
    "Segment", "Topology", "TuningRow", "Unknown", "all_reduce_segments", "canonical_order",
    "channel_count", "channel_cut", "channel_split", "communicator_channels", "default_channels",
    "load_topology",
    "orders_differ", "parse_list", "parse_nccl_log", "parse_topology", "predict",
    "primary_scenario", "read_log", "reduce_scatter_segments", "ring_families", "ring_index",
    "rings", "rules_for", "same_sum", "save_topology", "sum_order", "topology_from_log",
]
