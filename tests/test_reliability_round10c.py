"""Round 10c: a layer data parallel by DTensor alone (its parameters Replicate on a mesh, no FSDP
or DDP) gets its gradients back Partial, and an eager DTensor redistribution sums them (an
all-reduce, or a reduce-scatter). Round 9a found those ``dtensor`` lines right in size and order
but with ``fqn`` null: the diff could not say whose reduction moved, nor count the parameter as
reduced. parity/capture/sources/eager_grads.py now names them after the parameter whose gradient
they carry; a Partial activation stays unnamed.

Ground truth: ``parity exec`` of tests/trainers/round9a.py (imports nothing from parity) with
``R9_CASE=dtensor R9_DP=1``, whose wire recorder keeps every functional collective's input and
which saves each rank's Partial gradients after the backward (``pgrads``);
tests/wire_truth.py checks that a named reduction's inputs summed over the ranks are that
parameter's gradient and no other's, and that an unnamed one is no parameter's gradient.

Found and fixed (docs/reliability.md, "Round 10c"):

- the Partial gradients' all-reduces (inside the optimizer's step, or the trainer's
  ``p.grad.redistribute``), reduce-scatters (the trainer's, and the one ``Redistribute``'s
  backward runs for a Shard parameter) were written with ``fqn`` null;
- a Partial activation (a batch statistic of l0's output, all-reduced in the forward) of
  ``l0.bias``'s shape was named ``l0.bias`` (the shape fallback meant for a cast of a
  parameter);
- a gradient all-reduced on one side and reduce-scattered then all-gathered on the other
  (bitwise-equal values) FAILED naming ``reduce_scatter bucket None`` and no parameter; the
  eager DTensor all-reduces were in no all-reduce comparison.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, run_ok, trainer_runs, values_equal
from tests.wire_truth import Judge, values

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round9a.py")
TIMEOUT = 900
BASE = {"R9_CASE": "dtensor", "R9_DP": 1, "R9_STAT": 1, "R9_RSB": 1}
JOBS = {  # name: trainer knobs (exec=0: without parity)
    # l0's Partial gradients all-reduced inside SGD's step (DTensor's implicit redistribution;
    # step 1 inside ``grad.detach().clone()``), l3.w_t's reduce-scattered in the backward, a
    # Partial batch statistic of l0.bias's shape all-reduced in the forward
    "opt": {},
    "opt_again": {},
    "opt_bare": {"exec": 0},
    # the trainer's own p.grad.redistribute: one all-reduce / a reduce-scatter then an all-gather
    "ar": {"R9_RED": "ar"},
    "rsag": {"R9_RED": "rsag"},
}


# ------------------------------------------------------------------------- unit (no job)
def _source():
    """The eager DTensor source with hooks that keep what it emits, and a model of one
    parameter ``l0.weight`` whose ``.grad`` is DTensor-like (a local tensor ``g``)."""
    import torch

    from parity.capture.sources.eager_collectives import EagerCollectives
    from parity.capture.sources.manifest_source import SourceHooks

    emitted: list = []

    def nothing(*a, **k):
        return None

    src = EagerCollectives(SourceHooks(emitted.append, nothing, nothing, lambda: 1, nothing,
                                       nothing, nothing))
    g = torch.randn(6, 8)
    p = types.SimpleNamespace(shape=torch.Size([6, 8]), grad=types.SimpleNamespace(
        _local_tensor=g))

    class Root:
        def named_modules(self):
            return [("", self)]

        def named_parameters(self):
            return [("l0.weight", p)]

    return src, emitted, p, Root()


def _spec(*placements):
    return types.SimpleNamespace(placements=placements, mesh=types.SimpleNamespace(shape=(2,)),
                                 tensor_meta=None)


def test_a_partial_gradient_is_named_by_its_memory_at_the_call():
    """The Partial tensor an all-reduce is given is the parameter's ``.grad`` (or a detached
    alias of it: SGD's first step): named after it (it was null). A copy is not trusted, nor a
    stale map entry: the gradient replaced, a tensor at its old memory is unnamed."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    src, emitted, p, root = _source()
    src.modules = lambda: [root]
    wrapped = src._wrap(lambda t, cur, tgt, *a, **k: t.clone())
    old = p.grad._local_tensor
    wrapped(old.detach(), _spec(Partial()), _spec(Replicate()))  # an alias: named
    wrapped(old.clone(), _spec(Partial()), _spec(Replicate()))  # a copy: not
    wrapped(old, _spec(Partial()), _spec(Shard(0)))  # a reduce-scatter of it: named
    p.grad = types.SimpleNamespace(_local_tensor=old.clone())
    wrapped(old, _spec(Partial()), _spec(Replicate()))  # no longer the gradient
    src.new_step()
    got = [(r.collective, r.entries[0].fqn) for r in emitted]
    assert got == [("all_reduce", "l0.weight"), ("all_reduce", None),
                   ("reduce_scatter", "l0.weight"), ("all_reduce", None)]


def test_a_partial_activation_of_a_parameters_shape_stays_unnamed():
    """A Partial tensor all-reduced in a module's forward with the shape of that module's bias
    (a batch statistic) was named after the bias by the shape fallback meant for a cast of a
    parameter (a bf16 all-gather input); a Partial value is never such a copy. A bf16 cast of
    the bias all-gathered (Shard -> Replicate) under the same module is still named by it."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    src, emitted, _, _ = _source()
    lin = torch.nn.Linear(8, 6)
    src.modules = lambda: [lin]
    wrapped = src._wrap(lambda t, cur, tgt, *a, **k: t.clone())

    def forward(x, _m=lin):
        wrapped(torch.ones(6), _spec(Partial()), _spec(Replicate()))  # a statistic
        wrapped(_m.bias.detach().to(torch.bfloat16), _spec(Shard(0)), _spec(Replicate()))
        return x

    lin.forward = forward
    lin(torch.ones(1))
    src.new_step()
    assert [(r.collective, r.entries[0].fqn) for r in emitted] == [
        ("all_reduce", None), ("all_gather", "bias")]


# ------------------------------------------------------------------------ real jobs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trainer_runs(tmp_path_factory.mktemp("round10c"),
                        {name: {**BASE, **knobs} for name, knobs in JOBS.items()}, TRAINER,
                        "R9_", timeout=TIMEOUT)


def _judged(run: Path) -> Judge:
    j = Judge(run)
    problems = j.run()
    assert not problems, "\n".join(problems[:20])
    return j


def test_named_partial_gradient_reductions_are_the_bytes_sent(runs):
    """Every dtensor reduction line named after a parameter: the ranks' inputs summed are that
    parameter's gradient (and no other's); the statistic's all-reduce is unnamed and no
    gradient; every gradient summed on the wire is named."""
    j = _judged(run_ok(runs, "opt"))
    assert {(f, c) for _, _, f, c in j.named_reductions} == {
        ("l0.weight", "all_reduce"), ("l0.bias", "all_reduce"), ("l3.w_t", "reduce_scatter")}
    assert len(j.named_reductions) == 3 * 3 * 2  # 3 a step, 3 steps, 2 ranks
    assert j.unnamed_reductions == 3 * 2  # the statistic
    j = _judged(run_ok(runs, "rsag"))
    assert {(f, c) for _, _, f, c in j.named_reductions} == {
        ("l0.weight", "reduce_scatter"), ("l0.bias", "reduce_scatter"),
        ("l3.w_t", "reduce_scatter")}
    _judged(run_ok(runs, "ar"))


def test_capture_changes_nothing(runs):
    """Every step's shards, Partial and reduced gradients, losses and the final parameters are
    bitwise those of the job without ``parity exec``."""
    assert values_equal(values(run_ok(runs, "opt")), values(run_ok(runs, "opt_bare")))


def test_a_gradient_reduced_another_way_fails_naming_it(runs):
    """All-reduce against reduce-scatter + all-gather of l0's Partial gradients (bitwise-equal
    values on 2 ranks): FAILS under ``--fail-on any`` naming l0.weight, a reduction-structure
    difference (it read ``reduce_scatter bucket None`` and named nobody)."""
    a, b = run_ok(runs, "ar"), run_ok(runs, "rsag")
    assert values_equal(values(a), values(b))
    rc, line, js = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH, line
    assert "bucket partition differs (reduce_scatter bucket 1 of B position 0, l0.weight)" \
        in line and "reduction structure" in line and "hashes bitwise identical" in line, line
    # each parameter counted as reduced, by its name: one all-reduce in A, one reduce-scatter
    # in B (the old counts went by shape: l0.weight's momentum buffer row was "reduced" too)
    assert sorted((s["fqn"], s.get("collective", "reduce_scatter"), s["a"], s["b"])
                  for s in js["order"]["structure"]) == [
        ("l0.bias", "all_reduce", 1, 0), ("l0.bias", "reduce_scatter", 0, 1),
        ("l0.weight", "all_reduce", 1, 0), ("l0.weight", "reduce_scatter", 0, 1)]


def test_the_identical_pair_holds(runs):
    rc, line, _ = diff_cli(run_ok(runs, "opt"), run_ok(runs, "opt_again"), "--fail-on", "any",
                           timeout=TIMEOUT)
    assert rc == EXIT_OK and "bucket layouts identical" in line, line
