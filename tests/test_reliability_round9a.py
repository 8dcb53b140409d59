"""Round 9a: eager bucket manifests against the bytes actually sent. ``parity exec`` of
tests/trainers/round9a.py (imports nothing from parity), whose dispatch mode records every c10d
op's input as it goes on the wire; tests/wire_truth.py checks every buckets.jsonl entry against
those bytes (all-gather: the parameter's padded local shard, exact; reduce-scatter / all-reduce:
the ranks' inputs summed are the parameter's gradient, at that offset and no other) and that
every wire collective carrying parameter or gradient bytes is described by a line of its step.

Found and fixed (docs/reliability.md, "Round 9a"):

- DDP's first-iteration bucket (before the rebuild) was written with its parameters in reverse
  order: every offset wrong (DDP fills buckets from the first parameter on);
- ``static_graph`` DDP rebuilds its buckets at the third iteration and its logging data shows
  it one iteration later: a 3-step job's manifest held the first single bucket for every step
  while step 3 all-reduced three, so ``bucket_cap_mb`` 0.0002 against 25 HELD "bucket layouts
  identical" under ``--fail-on any`` (a longer job stamped the rebuild a step early). The plan
  is now read from the Reducer's buckets until the rebuild shows;
- DDP syncing several micro-batches a step: the step's one plan was repeated per pass, but
  DDP rebuilds its buckets between the first step's passes (each pass's own buckets now);
- an eager DTensor all-gather of an unevenly sharded parameter: the rank with the short shard
  recorded its local bytes (12) where DTensor pads and sends 16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, run_ok, trainer_runs, values_equal
from tests.wire_truth import _in_force, check, load, records, values

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round9a.py")
TIMEOUT = 900

JOBS = {  # name: trainer knobs (nproc: ranks, default 2; exec=0: without parity)
    # padding everywhere (5-, 6-, 7-row weights, 1-row l3, a 1-element root parameter), an
    # unused branch at step 2 (the root group's reduce-scatter shifts), a frozen bias
    "fsdp": {"R9_UNUSED": 1, "R9_FROZEN": 1},
    "fsdp_nowire": {"R9_UNUSED": 1, "R9_FROZEN": 1, "R9_WIRE": 0},
    "fsdp_bare": {"R9_UNUSED": 1, "R9_FROZEN": 1, "exec": 0},
    "fsdp_swap": {"R9_UNUSED": 1, "R9_FROZEN": 1, "R9_SWAP": 1},
    # the unused branch its own fully_shard group: step 2 issues fewer collectives than step 1
    "fsdp_extra": {"R9_GROUPS": "extra", "R9_UNUSED": 1},
    "fsdp_bf16": {"R9_MP": "bf16r"},
    "hsdp": {"R9_MESH": "hsdp", "nproc": 4},
    "ddp_static": {"R9_CASE": "ddp", "R9_STATIC": 1, "R9_CAP": 0.0002},
    "ddp_static_big": {"R9_CASE": "ddp", "R9_STATIC": 1},
    # two micro-batches a step, each syncing: DDP rebuilds between the first step's passes
    "ddp_accum": {"R9_CASE": "ddp", "R9_CAP": 0.0002, "R9_ACCUM": 2},
    # step 2 entirely under no_sync(): DDP all-reduces nothing there
    "ddp_quiet": {"R9_CASE": "ddp", "R9_CAP": 0.0002, "R9_QUIET": 2},
    # an uneven Shard(0) parameter all-gathered in the forward; l0 data parallel by DTensor
    # (its Partial gradients all-reduced inside DTensor's dispatch: the funcol wrapper sees them)
    "dtensor": {"R9_CASE": "dtensor", "R9_DP": 1},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trainer_runs(tmp_path_factory.mktemp("round9a"), JOBS, TRAINER, "R9_",
                        timeout=TIMEOUT)


def _judge(run: Path, rtol: float = 1e-5) -> int:
    problems, n = check(run, rtol)
    assert not problems, "\n".join(problems[:20])
    assert n > 0
    return n


def test_the_wire_recorder_changes_nothing(runs):
    """The dispatch mode and parity leave the job alone: values bitwise equal with and without
    either; parity's records (buckets.jsonl, step digests) equal with and without the mode."""
    a, b, c = run_ok(runs, "fsdp"), run_ok(runs, "fsdp_nowire"), run_ok(runs, "fsdp_bare")
    assert values_equal(values(a), values(b)) and values_equal(values(a), values(c))
    assert records(a) == records(b)


def test_fsdp2_manifests_are_the_bytes_sent(runs):
    """Padding, a frozen parameter, a parameter without gradient at step 2, root loose
    parameters, bf16 params and reduce, HSDP's reduce-scatter and replicate all-reduce."""
    _judge(run_ok(runs, "fsdp"))
    _judge(run_ok(runs, "fsdp_bf16"), rtol=2e-2)
    _judge(run_ok(runs, "hsdp"))


def test_a_step_with_fewer_fsdp2_collectives_ends_the_vanished_positions(runs):
    """The unused branch is its own ``fully_shard`` group: step 1 all-gathers it and
    reduce-scatters its gradients, step 2 does neither. Positions are written only when they
    change, so step 1's trailing lines stayed in force at step 2 (10 all-gathers where the wire
    had 8, ``l0.weight`` reduced twice) until the writer said where step 2's sequence ends (an
    ``ends`` line); parity's own reader (``records_at``) agrees with the judge's."""
    from parity.artifacts import read_run
    from parity.diff.reduction_steps import records_at

    run = run_ok(runs, "fsdp_extra")
    _judge(run)
    rd = read_run(run).ranks[0]
    assert rd.bucket_ends and not any(b.get("ends") for b in rd.buckets)
    _, manifests = load(run)
    for step in (1, 2, 3):
        got = records_at(rd.buckets, step, rd.bucket_ends)
        for kind in ("all_gather", "reduce_scatter"):
            mine = [(r["index"], r["step"]) for r in got
                    if r["source"] == "fsdp2" and r["collective"] == kind]
            judge = [(ln["index"], ln["step"]) for ln in _in_force(
                [ln for ln in manifests[0] if ln["source"] == "fsdp2"
                 and ln["collective"] == kind], step, True)]
            assert sorted(mine) == judge, (step, kind)


def test_a_layout_only_difference_fails_and_identical_holds(runs):
    a, b = run_ok(runs, "fsdp"), run_ok(runs, "fsdp_swap")
    assert values_equal(values(a), values(b))
    _judge(b)
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "bucket order differs" in line, line
    rc, line, _ = diff_cli(a, run_ok(runs, "fsdp_nowire"), "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_OK and "bucket layouts identical" in line, line


def test_ddp_first_iteration_bucket_is_in_parameter_order(runs):
    """DDP's bucket before its rebuild holds the parameters in parameter order (it was written
    reversed: every offset wrong); the rebuilt buckets were right."""
    _judge(run_ok(runs, "ddp_static_big"))


def test_static_graph_rebuild_is_written_at_its_step(runs):
    """static_graph rebuilds at the third iteration: a 3-step job's manifest held the first
    single bucket for every step, so a smaller bucket_cap_mb HELD "bucket layouts identical"
    under --fail-on any; now every step's entries are the bytes sent and the pair FAILS."""
    a, b = run_ok(runs, "ddp_static_big"), run_ok(runs, "ddp_static")
    _judge(b)
    assert values_equal(values(a), values(b))
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "bucket partition differs" in line, line


def test_each_syncing_pass_has_its_own_buckets(runs):
    """DDP syncing two micro-batches a step rebuilds its buckets at the second forward: step 1
    all-reduced its first single bucket, then the three rebuilt ones. The plan was read once a
    step and repeated per pass (the rebuilt buckets twice); each pass's buckets are now read as
    it begins."""
    _judge(run_ok(runs, "ddp_accum"))


def test_a_step_entirely_under_no_sync_all_reduces_no_ddp_bucket(runs):
    """Every backward of step 2 under ``no_sync()``: DDP all-reduced nothing, but its buckets
    were written only when they changed, so step 1's stayed in force for the reader at step 2
    (three all-reduces the wire never carried). An ``ends`` line (group ``ddp``) now says so, and
    step 3's buckets are written again; parity's reader agrees with the judge."""
    from parity.artifacts import read_run
    from parity.diff.reduction_steps import records_at

    run = run_ok(runs, "ddp_quiet")
    _judge(run)
    rd = read_run(run).ranks[0]
    ddp = {s: [r for r in records_at(rd.buckets, s, rd.bucket_ends) if r.get("group") == "ddp"]
           for s in (1, 2, 3)}
    assert ddp[1] and not ddp[2] and ddp[3], {s: len(v) for s, v in ddp.items()}
    assert [e["step"] for e in rd.bucket_ends if e.get("group") == "ddp"] == [2]


def test_uneven_dtensor_all_gather_records_the_padded_bytes(runs):
    """A 7-row Shard(0) parameter redistributed to Replicate on 2 ranks: rank 1 sends 4 rows
    (3 and a pad row), the manifest said 3."""
    _judge(run_ok(runs, "dtensor"))


def test_ddp_initial_buckets_fill_from_the_first_parameter():
    """DDP's initial assignment over parameters of 4, 8, 4 and 12 bytes cut at 8 bytes and
    then the cap (reported ``bucket_sizes`` in the Reducer's order: "12, 12, 4" is not it):
    buckets [0, 1], [2, 3] each in parameter order, the list reversed."""
    import torch

    from parity.capture.sources.c10d_allreduce import _ddp_groups

    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate((1, 2, 1, 3))]
    assert _ddp_groups({"bucket_sizes": "16, 12"}, params) == [[2, 3], [0, 1]]
    assert _ddp_groups({"bucket_sizes": "28"}, params) == [[0, 1, 2, 3]]


def test_the_reducer_is_read_once_in_the_step_ddp_rebuilds_and_never_at_a_backward():
    """Which buckets each syncing pass used comes from ``_has_rebuilt_buckets`` (noted before
    each ``backward()``: an attribute read); the Reducer's buckets, whose read allocates a
    zeroed copy of the gradients, are read once per DDP, at the end of the step that rebuilt
    them (the logging data shows them a step late), never at a backward (a fake DDP: pure
    logic)."""
    import types

    import torch

    from parity.capture.sources.c10d_allreduce import C10dAllReduces
    from parity.capture.sources.manifest_source import SourceHooks

    def nothing(*a, **k):
        return None

    src = C10dAllReduces(SourceHooks(nothing, nothing, nothing, lambda: 1, nothing, nothing,
                                     nothing))
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate((1, 2, 1, 3))]
    reads = []

    def zeros_like_grad_buckets():
        reads.append(1)  # the rebuilt buckets: [3, 2], [1, 0] (gradient-ready order)
        return [types.SimpleNamespace(parameters=lambda ps=ps: ps)
                for ps in ([params[3][1], params[2][1]], [params[1][1], params[0][1]])]

    ddp = types.SimpleNamespace(_has_rebuilt_buckets=False, require_forward_param_sync=True,
                                reducer=types.SimpleNamespace(
                                    _get_zeros_like_grad_buckets=zeros_like_grad_buckets))
    src._ddp_modules = lambda: [ddp]
    info = {"bucket_sizes": "16, 12"}  # initial: [2, 3], [0, 1]
    initial, rebuilt = [[2, 3], [0, 1]], [[3, 2], [1, 0]]
    # step 1: two micro-batches, DDP rebuilds in the second one's forward
    src._count_ddp_syncs()
    ddp._has_rebuilt_buckets = True
    src._count_ddp_syncs()
    assert reads == []  # nothing read at a backward
    assert src._ddp_plans(ddp, info, params, 2) == [initial, rebuilt]
    assert reads == [1]
    # step 2: the logging data still lags; the buckets read at step 1 serve
    src._count_ddp_syncs()
    assert src._ddp_plans(ddp, info, params, 1) == [rebuilt]
    assert reads == [1]
    # step 3: the logging data has them
    src._count_ddp_syncs()
    shown = dict(info, has_rebuilt_buckets=1, rebuilt_per_bucket_param_indices="3 2, 1 0")
    assert src._ddp_plans(ddp, shown, params, 1) == [rebuilt]
    assert reads == [1]


def test_a_sequence_source_with_no_collective_at_a_step_says_so():
    """The c10d and dtensor sources write a step's whole sequence when it changes; a step with
    none wrote nothing, and the reader held the last sequence in force. Now an ``ends`` line
    (index 0) at that step (pure logic: a c10d source with no job)."""
    from parity.capture.sources.c10d_allreduce import C10dAllReduces
    from parity.capture.sources.manifest_source import SourceHooks
    from parity.records import BucketEntry, BucketRecord, is_ends

    emitted, done = [], [1]

    def nothing(*a, **k):
        return None

    src = C10dAllReduces(SourceHooks(emitted.append, nothing, nothing, lambda: done[0], nothing,
                                     nothing, nothing))
    src._new_ddp_step = nothing
    src.current = [BucketRecord("c10d", "all_reduce", 0, [BucketEntry("w", 0, 4, 1, "float32")],
                                dtype="float32", world_size=2, total_bytes=4)]
    src.new_step()
    done[0] = 2
    src.new_step()  # step 2: no all-reduce
    done[0] = 3
    src.new_step()  # step 3: none again: nothing more to say
    lines = [r.to_dict() for r in emitted]
    assert [(ln["step"], is_ends(ln)) for ln in lines] == [(1, False), (2, True)]
    assert lines[1]["index"] == 0 and lines[1]["entries"] == []
