"""Which torch op namespaces are communication and bucket plumbing, for every module that sorts
ops: the op-level capture for bisect (capture/ops.py: recorded, never compared op by op) and the
FX walk (capture/sources/graph_walk.py: not compute between reduce-scatters). One tuple, so that the two
never disagree on what a collective is. Standard library only: capture imports it in every rank.
"""

# c10d / functional collectives, FSDP2's copy-in/out ops, the bucketing passes' ops, DTensor's
COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "fsdp", "bucketing", "_dtensor")
