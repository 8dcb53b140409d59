"""The manifest source protocol: what one hook point that records bucket layouts looks like to
the session, and the typed records it hands over.

A manifest source is one place where parity sees collectives being issued and writes their
bucket layouts (buckets.jsonl, docs/artifacts.md): FSDP2's collective functions (fsdp2.py),
aot_autograd's compilers (graph.py), GraphTrainer's make_fx tracer (graph_makefx.py), DTensor's
redistribution (eager_collectives.py). Each is one class implementing :class:`ManifestSource`,
listed once in capture/sources/registry.py; session.py keeps one table of them and knows none by name
(docs/architecture.md, "Adding a manifest source").

[Note: when a source installs]
A source names its ``trigger``: a module whose import installs it (the session registers a
post-import callback; a source whose module was only half-imported then says ``ready() ->
False`` and is asked again at ``torch.compile`` and at the first optimizer step), or
:data:`ON_COMPILE`, the trainer's first ``torch.compile`` call (patches.py: earlier, aot_autograd may be half-imported). Every
source is installed at most once per session; a reason returned by ``install`` becomes one
capture warning ``"<unavailable>: <reason>"`` (meta.json ``capture.warnings``) and the source
is not listed in ``capture.manifests``.

Standard library and records.py only: every capture path imports it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from parity.records import BucketRecord

__all__ = ["ON_COMPILE", "GraphRecord", "SourceHooks", "ManifestSource"]

ON_COMPILE = "torch.compile"  # a trigger: the trainer's first torch.compile call (patches.py)


@dataclass
class GraphRecord:
    """One compiled graph's bucket layouts, handed from a graph hook to the session.

    Attributes:
        graph: ``"forward"`` / ``"backward"`` (aot_autograd, graph.py) or ``"joint"`` (make_fx,
            graph_makefx.py; each bucket then says its own phase).
        graph_id: numbers compilations in order; a forward graph and the backward graph compiled
            from the same joint graph share it, and so do a graph before and after its passes.
        buckets: the graph's collectives in node order (graph_walk.extract_buckets); the session
            sets their ``step`` and normalizes their FQNs.
        warnings: what the walk could not resolve; the session records each as a capture warning.
        stage: ``"before_passes"`` / ``"after_passes"`` where the hook says it (make_fx); the
            buckets carry it too.
    """

    graph: str
    graph_id: int
    buckets: list[BucketRecord]
    warnings: list[str] = field(default_factory=list)
    stage: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the buckets as buckets.jsonl lines without ``v``)."""
        d: dict[str, Any] = {"graph": self.graph, "graph_id": self.graph_id,
                             "buckets": [b.to_dict() for b in self.buckets],
                             "warnings": list(self.warnings)}
        if self.stage is not None:
            d["stage"] = self.stage
        return d


class SourceHooks(NamedTuple):
    """What the session hands a manifest source (one per source: ``lost`` names it).

    Attributes:
        emit: write one :class:`~parity.records.BucketRecord` (the source has set its step).
        on_graph: hand over one :class:`GraphRecord` (the session sets the step).
        on_loss: the loss a traced step returned (its backward ran inside the graph: no
            ``.backward()`` call shows it).
        done: the last finished optimizer step (the one in progress is ``done() + 1``).
        warn: ``warn(msg, echo=True)``: a capture warning (meta.json), printed unless echo=False.
        lost: like ``warn``, and this source stops being listed in meta.json's
            ``capture.manifests``: it does not record (everything) it should.
        fail: ``fail(exception)``: capture broke; the session disables itself, training goes on.
    """

    emit: Callable[[BucketRecord], None]
    on_graph: Callable[[GraphRecord], None]
    on_loss: Callable[[Any], None]
    done: Callable[[], int]
    warn: Callable[..., None]
    lost: Callable[..., None]
    fail: Callable[[BaseException], None]


class ManifestSource(ABC):
    """One hook point that records bucket layouts; constructed by the session with its hooks.

    Attributes:
        name: its key in capture/sources/registry.py (unique).
        source: the ``source`` its bucket lines carry and meta.json's ``capture.manifests`` lists
            (``parity.records.SOURCE_*``); two hook points may write the same one.
        trigger: when it installs: a module name (once imported) or :data:`ON_COMPILE`.
        unavailable: how its warning starts when ``install`` returns a reason.
        echo: False where the hook has printed the reason on stderr already (graph.py).
        seconds: time spent recording so far (meta.json ``capture.seconds``).
    """

    name: ClassVar[str]
    source: ClassVar[str]
    trigger: ClassVar[str]
    unavailable: ClassVar[str]
    echo: ClassVar[bool] = True
    seconds: float = 0.0

    def __init__(self, hooks: SourceHooks) -> None:
        self.hooks = hooks

    def ready(self) -> bool:
        """False while the trigger module is only half-imported (asked again later)."""
        return True

    @abstractmethod
    def install(self) -> str | None:
        """Hook in; None when recording, else the reason it cannot (said once, as a warning)."""

    @abstractmethod
    def uninstall(self) -> None:
        """Restore what ``install`` patched. Idempotent; never raises for a missing hook."""

    def new_step(self) -> None:
        """An optimizer step finished: what comes next belongs to the next step."""


def sub_group_ranks(group: Any) -> list[int] | None:
    """The global ranks of a collective's process group, for the ``ranks`` field of a bucket
    line (docs/artifacts.md), or None for the whole world (implied by ``world_size``) and where
    they cannot be read. Why: two runs can reduce the same bytes over groups of the same size
    made of other ranks (a mesh transposed, experts placed on other ranks); at scale those
    groups sit elsewhere on the network, so the diff compares them (diff/buckets.py). A local
    lookup (c10d's own table), no collective; read once per group (the c10d and dtensor sources
    ask at every call, inside the training step)."""
    if group is None:
        return None
    got = _RANKS.get(id(group))
    if got is not None and got[0] is group:
        return list(got[1]) if got[1] is not None else None
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        ranks = None if group.size() == dist.get_world_size() else [
            int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:  # noqa: BLE001 - not readable (a fake or foreign group): not written
        return None
    _RANKS[id(group)] = (group, ranks)  # the group kept: its id is not reused while cached
    return list(ranks) if ranks is not None else None


_RANKS: dict[int, tuple[Any, list[int] | None]] = {}  # id(group) -> (group, its ranks or None)

EAGER_ALL_REDUCES = [0]
"""The plain ``dist.all_reduce`` calls the c10d source has recorded so far in this step
(c10d_allreduce.py sets it, 0 at each step's end). The functional source (eager_funcol.py)
writes it on each of its lines (``after``): the two sources write their sequences one after
the other at the step's end, so without it the diff read a token weight summed before the
gradients' all-reduces as issued after them, and paired unnamed scalars of the two sources
out of issue order (round 13a)."""


class _Redistributing(threading.local):
    """How deep this thread is inside DTensor's ``redistribute_local_tensor``, as the dtensor
    source's wrapper counts it (eager_collectives.py). Why: the functional source
    (eager_funcol.py) must not write the functional collectives a redistribution issues (the
    dtensor source writes the redistribution), and reading a counter costs nothing where
    walking the stack for a frame of that name cost up to 30 frame hops on every functional
    call (DTensor issues one per collective). Per thread: autograd runs a device's backward on
    its own thread."""

    depth = 0


REDISTRIBUTING = _Redistributing()
REDISTRIBUTE_WRAPPED = [False]
"""Whether the dtensor source's wrapper is in place (for every thread), so that
``REDISTRIBUTING`` counts; where it is not, the functional source walks the stack instead."""
