"""Round 13a: functional collectives (``torch.distributed._functional_collectives``) run eagerly,
outside any graph: torchtitan's ``dist_sum`` (the global token weight that normalises the loss)
and a trainer's own ``funcol.all_reduce`` / ``reduce_scatter_tensor``. ``parity exec`` of
tests/trainers/round13a.py (imports nothing from parity; saves every step's loss, token weight,
logged value, gradients and parameters, the final parameters and optimizer state), its values
compared with ``torch.equal`` between runs (the ground truth); one job of
tests/trainers/round12a.py (FSDP2, torch's clip over DTensor gradients) for what DTensor issues.

Found and fixed (docs/reliability.md, "Round 13a"): no manifest source saw these calls (they go
from Python to ``torch.ops._c10d_functional``, past ``dist.all_reduce``). A token weight summed
over a sub-group on one side and over the world on the other HELD "bucket layouts identical"
and ``--at 2x2`` predicted "same sums", saying nothing of the all-reduce; against a hand-written
``dist.all_reduce`` the pair read "not compared: ... no such all-reduce on the other side".
capture/sources/eager_funcol.py now writes them as c10d all-reduce lines (``"funcol": true``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import REPO, diff_cli, run_ok, trainer_runs, values_equal

TRAINER = str(REPO / "tests" / "trainers" / "round13a.py")
TRAINER_12A = str(REPO / "tests" / "trainers" / "round12a.py")
TIMEOUT = 900


def _titan() -> bool:
    try:
        import torchtitan.distributed.utils  # noqa: F401
    except Exception:  # noqa: BLE001 - torchtitan (and triton) not installed: those jobs left out
        return False
    return True


TITAN = _titan()
_S = {"R13A_STEPS": 2}
_M4 = {**_S, "R13A_MIRROR": 1, "nproc": 4}
JOBS = {  # name: trainer knobs (nproc: ranks, default 2; exec: 0 without parity)
    "c10d": {**_S, "R13A_TOK": "c10d"},  # the token weight by a hand-written dist.all_reduce
    "funcol": {**_S, "R13A_TOK": "funcol"},  # ... by funcol.all_reduce, eagerly
    "max": {**_S, "R13A_TOK": "max"},
    "log": {**_S, "R13A_TOK": "funcol", "R13A_LOG": "funcol"},  # + a logged-only all-reduce
    "rs": {**_S, "R13A_TOK": "funcol", "R13A_GRAD": "rs"},  # gradients by funcol RS + AG
    # 4 ranks, ranks 2 and 3 holding 0 and 1's data: over the world, or a sub-group doubled
    "world4": {**_M4, "R13A_TOK": "funcol"},
    "sub4": {**_M4, "R13A_TOK": "sub"},
}
if TITAN:
    JOBS.update({
        "titan": {**_S, "R13A_TOK": "titan"},  # torchtitan's dist_sum
        "titan_bare": {**_S, "R13A_TOK": "titan", "exec": 0},
        # FSDP2, torch's clip (DTensor's own functional all-reduce), the token by dist_sum
        "clip": {"entry": [TRAINER_12A], "R12A_CLIP": "torch", "R12A_TOK": "titan",
                 "R12A_STEPS": 2},
        # FSDP2, a hand clip (inf: a MAX dist.all_reduce after backward), the token weight
        # summed before the forward's loss by dist.all_reduce or by dist_sum
        "hand_world": {"entry": [TRAINER_12A], "R12A_CLIP": "hand", "R12A_NORM": "inf",
                       "R12A_TOK": "world", "R12A_STEPS": 2},
        "hand_titan": {"entry": [TRAINER_12A], "R12A_CLIP": "hand", "R12A_NORM": "inf",
                       "R12A_TOK": "titan", "R12A_STEPS": 2},
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("round13a")
    jobs = {n: ({**k, "R12A_SAVE": f"{root / n}.truth"} if "entry" in k else k)
            for n, k in JOBS.items()}  # round12a.py saves its ground truth at R12A_SAVE
    return trainer_runs(root, jobs, TRAINER, "R13A_", timeout=TIMEOUT)


def values(run: Path, nproc: int = 2) -> list:
    """Every rank's saved ground truth: steps, final parameters, optimizer state."""
    import torch

    out = []
    for r in range(nproc):
        t = torch.load(f"{run}.truth.{r}", weights_only=False)
        out.append({k: t[k] for k in ("steps", "final", "opt")})
    return out


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "rank-00000" / "buckets.jsonl").read_text().splitlines()
            if x.strip()]


needs_titan = pytest.mark.skipif(not TITAN, reason="torchtitan 0.3.0 not importable")


@needs_titan
def test_dist_sum_against_dist_all_reduce_is_compared(runs):
    """torchtitan's ``dist_sum`` against a hand-written ``dist.all_reduce`` of the same token
    weight: values bitwise equal. Was HOLDS with "not compared: ... 1 all-reduce(s) of A
    carrying no parameter ... have no such all-reduce on the other side" (``dist_sum`` was
    recorded nowhere); now both are compared: HOLDS "bucket layouts identical", nothing left
    out. Capture changes nothing: the ``dist_sum`` job with and without ``parity exec``."""
    a, b = run_ok(runs, "c10d"), run_ok(runs, "titan")
    assert values_equal(values(a), values(b))
    assert values_equal(values(b), values(run_ok(runs, "titan_bare")))
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_OK and "bucket layouts identical" in line, line
    assert "not compared" not in line, line
    funcol = [r for r in _lines(b) if r.get("funcol")]
    assert funcol and funcol[0]["group"] == "utils.py:_dist_reduce_tensor", funcol
    assert funcol[0]["op"] == "sum" and funcol[0]["world_size"] == 2


def test_a_token_weight_over_a_sub_group_is_not_identical(runs):
    """4 ranks, the token weight summed by ``funcol.all_reduce`` over the world against over
    mesh dimension 1 of a (2, 2) mesh, doubled (each half holds the same data): values equal
    here. Was HOLDS "bucket layouts identical" and "same sums predicted" at 2x2 (no line was
    written); now the group differs and the prediction is unknown."""
    a, b = run_ok(runs, "world4"), run_ok(runs, "sub4")
    assert values_equal(values(a, 4), values(b, 4))
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "bucket group differs" in line, line
    assert "group of 4 ranks in A, 2 in B" in line, line
    rc, line, _ = diff_cli(a, b, "--fail-on", "reduction", "--at", "2x2", timeout=TIMEOUT)
    assert rc == EXIT_INCOMPLETE and "unknown" in line and "same sums" not in line, line


def test_max_against_sum_says_the_op(runs):
    """MAX against SUM: values differ from step 1; the verdict now names the all-reduce's op
    too (was: the hashes only, "bucket layouts identical")."""
    a, b = run_ok(runs, "funcol"), run_ok(runs, "max")
    assert not values_equal(values(a), values(b))
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "hash mismatch from step 1" in line, line
    assert "reduce op sum in A, max in B" in line, line


def test_a_logged_only_funcol_all_reduce_is_said(runs):
    """A logging-only ``funcol.all_reduce`` of the loss added: every trained value equal (the
    logged value is not trained on). Was HOLDS identical with nothing said; now it is the
    extra all-reduce (``tolerated`` under ``--fail-on hash``), as a hand-written one is
    (round 12a)."""
    a, b = run_ok(runs, "funcol"), run_ok(runs, "log")
    va, vb = values(a), values(b)
    for x, y in zip(va, vb):
        for s in x["steps"] + y["steps"]:
            s.pop("logged")
    assert values_equal(va, vb)
    rc, line, _ = diff_cli(a, b, "--fail-on", "hash", timeout=TIMEOUT)
    assert rc == EXIT_OK and "tolerated: bucket partition differs" in line, line


def test_an_eager_funcol_reduce_scatter_is_said(runs):
    """Gradients reduce-scattered and all-gathered back with ``funcol`` (a hand-written
    ZeRO-like reduction) against per-gradient ``dist.all_reduce``: values equal on gloo. Not
    written as buckets (no layout comparison reads them); was "bucket layouts unavailable"
    and nothing more, now each call site is a capture warning on the verdict line."""
    a, b = run_ok(runs, "funcol"), run_ok(runs, "rs")
    assert values_equal(values(a), values(b))
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_INCOMPLETE, line
    assert "functional reduce_scatter_tensor run eagerly at round13a.py:_reduce_grads" in line


@needs_titan
def test_dtensor_functional_calls_are_not_recorded_twice(runs):
    """FSDP2 with torch's clip: DTensor all-reduces the norm with ``funcol.all_reduce`` inside
    ``redistribute_local_tensor`` (the dtensor source's line); only the trainer's
    ``dist_sum`` is a funcol line, and no warning is written."""
    run = run_ok(runs, "clip")
    lines = [r for r in _lines(run) if r.get("collective") == "all_reduce"]
    assert [r["source"] for r in lines if not r.get("funcol")] == ["dtensor"], lines
    assert len([r for r in lines if r.get("funcol")]) == 1, lines
    meta = json.loads((run / "rank-00000" / "meta.json").read_text())
    assert not meta["capture"]["warnings"], meta["capture"]["warnings"]


def test_records_at_keeps_the_funcol_sequence_apart():
    """The funcol lines are a c10d sequence of their own: the c10d source writing its sequence
    at step 1 only and the funcol source again at step 2 leaves both in force at step 2 (one
    ``c10d`` sequence would keep only step 2's lines, and lose the hand-written all-reduces)."""
    from parity.diff.reduction_steps import records_at

    c10d = {"source": "c10d", "collective": "all_reduce", "step": 1, "index": 0, "group": "x:f"}
    f1 = {"source": "c10d", "collective": "all_reduce", "step": 1, "index": 0, "funcol": True}
    f2 = {**f1, "step": 2, "op": "max"}
    assert records_at([c10d, f1, f2], 2) == [c10d, f2]
    end = {**f1, "step": 2, "ends": True}
    assert records_at([c10d, f1], 2, [end]) == [c10d]


@needs_titan
def test_functional_and_hand_written_all_reduces_are_read_in_issue_order(runs):
    """The token weight summed (SUM) before the loss, the clip's norm all-reduced (MAX) after
    backward: by two ``dist.all_reduce`` on A, by ``dist_sum`` then ``dist.all_reduce`` on B.
    Values bitwise equal. The two sources write their sequences one after the other at the
    step's end, so B's lines read [norm MAX, token SUM]: paired in that order with A's [token
    SUM, norm MAX] the pair was ``layout_differs`` (a difference nobody made); the funcol
    line's ``after`` puts it back in issue order: identical."""
    a, b = run_ok(runs, "hand_world"), run_ok(runs, "hand_titan")
    assert values_equal(values(a), values(b))
    assert [r.get("after") for r in _lines(b) if r.get("funcol")] == [0]
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_OK and "bucket layouts identical" in line, line


def test_issue_order_unit():
    """``all_reduce_buckets``: a functional all-reduce with ``after`` k goes after the k-th of
    the c10d source's own all-reduces; DDP's and graph lines keep their places; lines without
    ``after`` (older runs) stay in record order."""
    from parity.diff.reduction_steps import all_reduce_buckets

    def line(group, fqn=None, **kw):
        return {"source": "c10d", "collective": "all_reduce", "step": 1, "index": 0,
                "group": group, "dtype": "float32", "world_size": 2, "total_bytes": 4,
                "entries": [{"fqn": fqn, "offset": 0, "size": 4, "numel": 1,
                             "dtype": "float32"}], **kw}

    ddp, g1, g2 = line("ddp", "w"), line("t.py:f", "a"), line("t.py:f", "b")
    tok = line("utils.py:_dist_reduce_tensor", funcol=True, after=0)
    late = {**tok, "after": 2, "group": "t.py:log"}
    got = all_reduce_buckets([ddp, g1, g2, tok, late])
    assert [b.module for b in got] == ["ddp", "utils.py:_dist_reduce_tensor", "t.py:f",
                                       "t.py:f", "t.py:log"]
    assert [b.index for b in got] == [0, 1, 2, 3, 4]
    old = {k: v for k, v in tok.items() if k != "after"}
    assert [b.module for b in all_reduce_buckets([g1, old])] == ["t.py:f",
                                                                  "utils.py:_dist_reduce_tensor"]


def test_a_gradient_all_reduced_in_a_backward_is_named():
    """An ``autograd.Function`` whose backward all-reduces the gradient (a DDP-style identity,
    tests/trainers/compiled_allreduce.py run eagerly): the gradient is no ``.grad`` yet, so the
    entry had no name and such a run read as gradients moved out of every bucket against its
    compiled twin, which names them; now the parameter whose ``AccumulateGrad`` the running
    node feeds alone (``--mode eager`` against ``--mode compiled``: HOLDS identical)."""
    import torch

    from parity.capture.sources.eager_funcol import EagerFuncol

    src = EagerFuncol.__new__(EagerFuncol)
    seen = []

    class Sync(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p):
            return p.view_as(p)

        @staticmethod
        def backward(ctx, g):
            seen.append(src._backward_leaf(g))
            return g

    net = torch.nn.Linear(3, 2)
    (torch.nn.functional.linear(torch.ones(1, 3), Sync.apply(net.weight), net.bias)).sum() \
        .backward()
    assert seen == ["weight"]
    assert src._backward_leaf(torch.ones(2, 3)) is None  # outside a backward


def test_a_funcol_gradient_is_named_by_its_grads_memory(monkeypatch):
    """A plain gradient all-reduced with ``funcol.all_reduce`` is named after the parameter
    whose ``.grad`` has its memory (a copy is not); the parameters are scanned once a step into
    a map (eager_grads.GradMap over plain tensors), not walked per call."""
    import torch

    import parity.capture.table as table
    from parity.capture.sources.eager_funcol import EagerFuncol

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    monkeypatch.setattr(table, "_module_roots", lambda: [net])
    src = EagerFuncol.__new__(EagerFuncol)
    assert [src._grad_of(p.grad) for p in net.parameters()] == [
        "0.weight", "0.bias", "1.weight", "1.bias"]
    assert src._grad_of(net[0].weight.grad.clone()) is None
    assert src._grad_of(torch.zeros(3, 3)) is None


def test_a_redistribution_is_read_off_the_dtensor_wrappers_counter():
    """Inside a redistribution the dtensor source's wrapper has counted (REDISTRIBUTING), the
    functional source skips a call without walking the stack; a call of the job's own outside
    one is recorded without walking either; where the wrapper is not in place, or a DTensor
    file calls outside the counted calls, the stack says it (a frame named
    ``redistribute_local_tensor``)."""
    import sys

    from parity.capture.sources import eager_funcol, manifest_source

    here = sys._getframe()

    def redistribute_local_tensor():  # a frame of that name on the stack, as torch's
        return sys._getframe()

    inner = redistribute_local_tensor()
    assert inner.f_code.co_name == "redistribute_local_tensor"
    wrapped, depth = manifest_source.REDISTRIBUTE_WRAPPED, manifest_source.REDISTRIBUTING
    before = wrapped[0], depth.depth
    try:
        wrapped[0], depth.depth = True, 0
        assert eager_funcol._in_redistribute(here) is False
        assert eager_funcol._in_redistribute(inner) is False  # the counter decides
        depth.depth = 1
        assert eager_funcol._in_redistribute(here) is True
        wrapped[0], depth.depth = False, 0
        assert eager_funcol._in_redistribute(inner) is True  # no wrapper: the stack says it
        assert eager_funcol._in_redistribute(here) is False
    finally:
        wrapped[0], depth.depth = before


def test_the_dtensor_wrapper_counts_its_calls_and_uncounts_on_error():
    """The dtensor source's wrapper raises its thread's depth over the original call, and
    lowers it again when the call raises."""
    from parity.capture.sources import manifest_source
    from parity.capture.sources.eager_collectives import EagerCollectives

    seen = []

    def original(local, current, target, *args, **kwargs):
        seen.append(manifest_source.REDISTRIBUTING.depth)
        if kwargs.get("fail"):
            raise RuntimeError("boom")
        return local

    src = EagerCollectives.__new__(EagerCollectives)
    src.busy, src.tracing = True, lambda: False  # busy: record nothing, call through
    wrapped = src._wrap(original)
    assert wrapped(1, None, None) == 1
    with pytest.raises(RuntimeError):
        wrapped(1, None, None, fail=True)
    assert seen == [1, 1] and manifest_source.REDISTRIBUTING.depth == 0
