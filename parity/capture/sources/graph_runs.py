"""How many times a compiled backward graph's reduce-scatters ran in a step (round 15d).

Why: a graph's bucket lines are written once, when it is compiled; eager FSDP2 writes its
buckets at every reduce-scatter it issues. With gradient accumulation a compiled backward runs
once per micro-batch, so its reduce-scatters run 2 or 3 times a step, and the diff read them
as run once: a compiled job reduce-scattering at each of 2 micro-batches against eager FSDP2
with ``set_requires_gradient_sync(False)`` on the first was "bucket layouts identical" and
``--at 8x8`` "same sums predicted" (the gradients differ on gloo); against eager FSDP2 syncing
at every micro-batch (bitwise identical) it read "a gradient reduced by a different number of
collectives (2 in A, 1 in B per step)" and ``--at 8x8`` FAILED.

What: before each outermost ``backward()`` of a step after its first (patches.ON_BACKWARD),
the reduce-scatter lines of every backward graph compiled so far are written again, stamped
with the step and ``passes`` (the number of that backward call in the step), once per graph
and number of passes larger than any written before (a job of 8 micro-batches writes its
graphs' lines again 7 times in all, not 7 times a step). The diff (parity/diff/buckets.py,
``graph_passes``) counts each such gradient ``passes`` times per step.

A backward pass counts where its autograd graph reaches a compiled function
(:func:`reaches_compiled`: a chunked loss's per-chunk ``backward()`` stops at the detached
hidden state and is not counted), and then for every backward graph compiled so far: one that
reaches another compiled region only (two compiled models, each its own micro-batch loop) is
counted for both (docs/reliability.md, round 15d).
"""

from __future__ import annotations

from collections import deque

from parity.capture import patches
from parity.capture.sources.manifest_source import GraphRecord
from parity.records import BucketRecord

PASSES = "passes"  # the bucket line's key (docs/artifacts.md)
WALK_CAP = 20_000  # autograd nodes walked to find a compiled function (reaches_compiled)


def reaches_compiled(roots, cap: int = WALK_CAP) -> bool:
    """Whether the autograd graph of ``roots`` (a tensor, or a list or tuple of them) holds a
    compiled function's backward (aot_autograd's ``CompiledFunctionBackward``), walked
    breadth-first from the roots; True past ``cap`` nodes (not known: counted, as before the
    walk). Why: a chunked loss calls ``backward()`` on each chunk's loss, whose graph stops at
    the detached hidden state, before the total's backward runs the model's graph once."""
    todo = deque(getattr(t, "grad_fn", None)
                 for t in (roots if isinstance(roots, (list, tuple)) else [roots]))
    seen: set = set()
    while todo:
        node = todo.popleft()
        if node is None or id(node) in seen:
            continue
        if type(node).__name__ == "CompiledFunctionBackward":
            return True
        seen.add(id(node))
        if len(seen) > cap:
            return True
        todo.extend(n for n, _ in getattr(node, "next_functions", ()) if n is not None)
    return False


def _copies(buckets: list[BucketRecord]) -> list[BucketRecord]:
    """Copies through the line's own form (the ``ABSENT`` markers stay themselves)."""
    return [BucketRecord.from_dict(b.to_dict()) for b in buckets]


class BackwardPasses:
    """Counts a step's outermost backward passes and writes the backward graphs' reduce-scatter
    lines again with ``passes`` (see the module docstring). ``on_graph``: the session's."""

    def __init__(self, on_graph) -> None:
        self.on_graph = on_graph
        self.graphs: dict[int, GraphRecord] = {}  # graph_id -> its reduce-scatters (backward)
        self.said: dict[int, int] = {}  # graph_id -> the most passes written
        self.count = 0  # outermost backward calls this step

    def keep(self, record: GraphRecord) -> None:
        """Remember a backward graph's reduce-scatter buckets (a copy: the session stamps the
        originals). The last compilation of a graph id wins (a recompile)."""
        if record.graph != "backward" or record.stage == "before_passes":
            return
        rs = [b for b in record.buckets if b.collective == "reduce_scatter"]
        if rs:
            self.graphs[record.graph_id] = GraphRecord(record.graph, record.graph_id,
                                                       _copies(rs), [], record.stage)

    def on_backward(self) -> None:
        """Before an outermost backward: the count, and the lines of a new larger count. A
        backward whose autograd graph reaches no compiled function is not counted."""
        if self.graphs and not reaches_compiled(patches.BACKWARD_OF[0]):
            return  # (no graph yet: the first backward, which compiles it, is counted unwalked)
        self.count += 1
        if self.count < 2:
            return
        for gid, rec in list(self.graphs.items()):
            if self.said.get(gid, 1) >= self.count:
                continue
            self.said[gid] = self.count
            buckets = _copies(rec.buckets)
            for b in buckets:
                b.extra[PASSES] = self.count
            self.on_graph(GraphRecord(rec.graph, gid, buckets, [], rec.stage))

    def new_step(self) -> None:
        self.count = 0

    def install(self) -> None:
        if self.on_backward not in patches.ON_BACKWARD:
            patches.ON_BACKWARD.append(self.on_backward)

    def uninstall(self) -> None:
        if self.on_backward in patches.ON_BACKWARD:
            patches.ON_BACKWARD.remove(self.on_backward)
