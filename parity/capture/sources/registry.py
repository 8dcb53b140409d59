"""The manifest sources, in one list: the session installs what is here and nothing else.

A new source is one module with one :class:`~parity.capture.sources.manifest_source.ManifestSource`
class, and one line below (docs/architecture.md, "Adding a manifest source"). The order is the
order their triggers are registered at session start and the order they are uninstalled.
"""

from __future__ import annotations

from parity.capture.sources.c10d_allreduce import C10dAllReduces
from parity.capture.sources.eager_collectives import EagerCollectives
from parity.capture.sources.eager_funcol import EagerFuncol
from parity.capture.sources.fsdp2 import FSDP2Recorder
from parity.capture.sources.graph import CompiledGraphs
from parity.capture.sources.graph_makefx import MakeFxGraphs
from parity.capture.sources.manifest_source import ManifestSource

__all__ = ["SOURCES", "BY_NAME"]

SOURCES: tuple[type[ManifestSource], ...] = (
    FSDP2Recorder,  # eager FSDP2's foreach_all_gather / foreach_reduce
    MakeFxGraphs,  # GraphTrainer's make_fx-traced step (aot_fx_trace)
    EagerCollectives,  # DTensor redistributions outside graphs
    CompiledGraphs,  # aot_autograd's compilers (torch.compile, SimpleFSDP, GraphTrainer jit)
    C10dAllReduces,  # plain all-reduces outside graphs (HSDP's replicate group, hand-written)
    EagerFuncol,  # functional all-reduces run eagerly (torchtitan's dist_sum, hand-written)
)
BY_NAME: dict[str, type[ManifestSource]] = {s.name: s for s in SOURCES}
assert len(BY_NAME) == len(SOURCES), "two manifest sources share a name"
