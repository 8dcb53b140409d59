"""``parity nccl-probe``: check the reduction-order model against a real cluster, bit for bit.

Every rank of a torchrun or SLURM job runs the same reduce-scatters and all-reduces of seeded
inputs (:mod:`parity.probe.cases`), compares what NCCL computed with what the model's emulation
computes for the same inputs (:mod:`parity.probe.rank`), and rank 0 turns the outcome and the
NCCL logs into ``DIR/topology.json`` and a report (:mod:`parity.probe.analysis`). A topology file
carries its agreement figure into every prediction and emulation that uses it
(:mod:`parity.nccl.probe_file`). docs/nccl-probe.md is the user's guide.

Modules: ``cases`` (the case matrix, the size ladder, ``--sizes-from``, the seeded inputs),
``orders`` (which summation order reproduces a sum's bits), ``rank`` (the job every rank runs),
``cluster`` (hosts, GPUs, NICs from the ranks and the logs), ``analysis`` (agreement, topology
file, report), ``launch`` (start the probe job with a sweep spec's launcher).
"""
